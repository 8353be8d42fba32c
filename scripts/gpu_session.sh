#!/usr/bin/env bash
# The GPU check (issue 9) and its profiles in one device call, for a session lent a CUDA GPU.
#
#   bash scripts/gpu_session.sh prepare   # here, once: the wheels the device image lacks -> .whl/
#   bash scripts/gpu_session.sh check     # here: every stage's Hydra overrides parse (no GPU needed)
#   bash scripts/gpu_session.sh device    # on the GPU machine, in one call carrying .whl, timeout 600 s
#
# The device image has torch, Triton, rich, matplotlib, tokenizers and safetensors, but not Hydra,
# OmegaConf or their ANTLR runtime, and an older transformers than the HF reference (5.23.0), so
# `prepare` downloads those four as Python 3.12 wheels (about 14 MB; antlr4 4.9.3 ships only as a
# source archive and is built into a wheel here). `device` installs them under /tmp/site, then runs
# the stages below in order of importance, each within what is left of a 580 s budget, and packs
# every log and output into $OUT/gpu_session.tgz, with the log also as $OUT/gpu_session.log.
# What travels: the tracked tree (38 MB on 2026-12-07, most of it benchmarks/results and the
# checkpoint) and .whl (14 MB), within the device call's 64 MiB.
#
# Stages (each line: name, seconds it may take at most, command):
#   preset        540  the GPU check itself (issue 9: within 8 minutes; 60 s more so that a slow run still reports)
#   profile-k8     60  where a k = 8 decode step's GPU time goes (CUDA graphs)
#   profile-plain  45  the same for plain decoding
#   compiled       90  inductor's kernels inside the graphs (modes compiled_graphs vs graphs, k = 8, batch 1)
set -uo pipefail

cd "$(dirname "$0")/.."

stages() {
    echo "preset 540 scripts/bench.py --config-name bench_gpu output_dir=\$DIR/preset"
    echo "profile-k8 60 scripts/profile_step.py device=cuda spec.num_tokens=8 steps=20 top=30 output=\$DIR/profile-k8.json"
    echo "profile-plain 45 scripts/profile_step.py device=cuda drafter=none steps=20 top=30 output=\$DIR/profile-plain.json"
    echo "compiled 90 scripts/bench.py --config-name bench_gpu modes=[graphs,compiled_graphs] batch_sizes=[1]" \
        "num_tokens=[8] hf=[] kernel_timings=false forward_ops=[] max_new_tokens=32 output_dir=\$DIR/compiled"
}

WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 transformers==5.23.0)
ANTLR=antlr4-python3-runtime==4.9.3
BUDGET_S=580
PYTHON=${PYTHON:-python3}  # the device image's python3 holds its torch

prepare() {
    mkdir -p .whl
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}" || exit 1
    "$PYTHON" -m pip wheel -q --no-deps -w .whl "$ANTLR" || exit 1
    ls -l .whl
    echo "carry .whl in the device call: run(command=\"bash scripts/gpu_session.sh device\", carry=[\".whl\"], timeout_s=600)"
}

check() {
    # every stage's overrides against its config, as Hydra reads them (--cfg job prints, runs nothing)
    local DIR name limit cmd
    DIR=$(mktemp -d) || return 1
    trap 'rm -rf "$DIR"' RETURN
    while read -r name limit cmd; do
        set -f && eval "set -- $cmd" && set +f
        # Hydra's composition catches a key that does not exist; the benchmark's own option check
        # (bench_options) catches a bad value, such as a mode that is not one
        if "$PYTHON" "$@" --cfg job >"$DIR/config.yaml" && { [ "$1" != scripts/bench.py ] || "$PYTHON" -c \
            "import sys; from omegaconf import OmegaConf; from inkfw.bench.run import bench_options
bench_options(OmegaConf.load(sys.argv[1]))" "$DIR/config.yaml"; }; then
            echo "ok  $name (at most ${limit} s): $cmd"
        else
            echo "gpu_session.sh: stage $name's command does not parse: $cmd" >&2
            return 1
        fi
    done < <(stages)
}

device() {
    if [ -z "${OUT:-}" ]; then
        echo "gpu_session.sh: \$OUT is not set; 'device' runs on the device machine, which sets it" >&2
        exit 2
    fi
    if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
        echo "gpu_session.sh: no CUDA GPU here (nvidia-smi failed); 'device' runs on the GPU machine" >&2
        exit 2
    fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_session.sh: no wheels in .whl/; run 'bash scripts/gpu_session.sh prepare' here and carry .whl" >&2
        exit 2
    fi
    local DIR=/tmp/gpu_session start=$SECONDS name limit cmd left rc t0
    rm -rf "$DIR" && mkdir -p "$DIR"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        "$PYTHON" -c "import torch, triton, transformers, hydra; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__)"
        echo "cpus $(nproc)"
        git rev-parse HEAD 2>/dev/null || echo "commit: not a git checkout"
    } >"$DIR/env.txt" 2>&1
    cat "$DIR/env.txt"
    while read -r name limit cmd; do
        left=$((BUDGET_S - (SECONDS - start)))
        [ "$left" -lt "$limit" ] && limit=$left
        if [ "$limit" -lt 20 ]; then
            echo "== $name: skipped, under 20 s of the ${BUDGET_S} s budget left for it"
            continue
        fi
        set -f && eval "set -- $cmd" && set +f
        echo "== $name (at most ${limit} s, at $((SECONDS - start)) s): $cmd"
        t0=$SECONDS
        timeout "$limit" "$PYTHON" "$@" >"$DIR/$name.log" 2>&1
        rc=$?
        tail -n 40 "$DIR/$name.log"
        echo "== $name: rc=$rc in $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ' (timed out)')"
    done < <(stages) 2>&1 | tee "$DIR/session.log"
    cp "$DIR/session.log" "$OUT/gpu_session.log"
    tar czf "$OUT/gpu_session.tgz" -C /tmp gpu_session
    echo "packed $(du -h "$OUT/gpu_session.tgz" | cut -f1) into \$OUT/gpu_session.tgz at $((SECONDS - start)) s"
}

case "${1:-}" in
prepare | check | device) "$1" ;;
*)
    echo "usage: bash scripts/gpu_session.sh prepare|check|device (see the comment at the top)" >&2
    exit 2
    ;;
esac
