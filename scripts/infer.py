"""Speculative decoding: multi-depth MTP (or n-gram, or no) drafts verified by the target model.

The same program as the console script ``inkfw-infer`` (:func:`inkfw.entrypoints.infer_main`)."""

from inkfw.entrypoints import infer_main

if __name__ == "__main__":
    infer_main()
