"""Train MTP depths on a frozen Inkling backbone, or a small Inkling from scratch.

The same program as the console script ``inkfw-train`` (:func:`inkfw.entrypoints.train_main`)."""

from inkfw.entrypoints import train_main

if __name__ == "__main__":
    train_main()
