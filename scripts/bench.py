"""The benchmark: inkfw plain and MTP decoding against HF transformers ``generate`` on one
checkpoint (``inkfw/conf/bench.yaml``; the GPU check: ``--config-name bench_gpu``).

The same program as the console script ``inkfw-bench`` (:func:`inkfw.entrypoints.bench_main`)."""

from inkfw.entrypoints import bench_main

if __name__ == "__main__":
    bench_main()
