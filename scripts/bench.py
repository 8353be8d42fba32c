"""Engine benchmark: overhead (step time / forward time), tokens/s and KV bytes per configuration.

The same program as the console script ``inkfw-bench`` (:func:`inkfw.entrypoints.bench_main`)."""

from inkfw.entrypoints import bench_main

if __name__ == "__main__":
    bench_main()
