#!/usr/bin/env bash
# The GPU checks of docs/gpus.md, as one script for a GPU machine without Rust: the parity tests
# and the speed anchors beside PyTorch eager, in one run. Prepare on the build machine:
#
#   scripts/cuda-build.sh --tests --pack DIR     # DIR/zerodp.xz, DIR/gpu.xz (xz: 61 MB -> 8 MB each)
#   cp -r ../shared/peers DIR/peers              # torch_gpt.py for the PyTorch side
#   cp scripts/gpu_check.sh scripts/gpu_peer_bench.py examples/gpu_offload_10b.json DIR/
#
# then on the GPU machine: `bash DIR/gpu_check.sh DIR` (everything printed to stdout).
set -uo pipefail
DIR="$(cd "${1:-$(dirname "$0")}" && pwd)"
export LD_LIBRARY_PATH="/usr/local/cuda-13.0/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for f in zerodp gpu; do
    if [[ -f "$DIR/$f.xz" && ! -x "$DIR/$f" ]]; then
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$DIR/$f.xz" "$DIR/$f"
        chmod +x "$DIR/$f"
    fi
done
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)'
echo "== parity (tests/gpu.rs)"
if ! (cd "$DIR" && timeout 300 ./gpu gpu_ --nocapture --test-threads 1 > /tmp/parity.log 2>&1); then
    tail -40 /tmp/parity.log
    # Which side failed: the same tests on candle's composite ops instead of zerodp's CUDA kernels.
    echo "== parity with ZERODP_CUDA_KERNELS=0"
    (cd "$DIR" && ZERODP_CUDA_KERNELS=0 timeout 300 ./gpu gpu_ --nocapture --test-threads 1 2>&1 | tail -20)
else
    tail -12 /tmp/parity.log
fi
echo "== NCCL: bench comm --nccl (one rank per GPU)"
timeout 120 "$DIR/zerodp" bench comm --nccl --sizes 1M,64M --iters 3 2>&1 | tail -12
bench() { # label, zerodp args...
    local label="$1"; shift
    echo "== $label: zerodp"
    timeout 240 "$DIR/zerodp" bench train --device cuda --stages 0 --world-sizes 1 --warmup 3 --steps 10 --rounds 1 --format json "$@" 2>&1 |
        grep -E '"tokens_per_s"|"forward"|"backward"|"comm"|"optimizer"|error|device' | head -8
}
peer() { # label, peer args...
    local label="$1"; shift
    echo "== $label: PyTorch eager"
    timeout 240 python3 "$DIR/gpu_peer_bench.py" --peers "$DIR/peers" "$@" 2>&1 | tail -2
}
for round in 1 2; do
    echo "=== round $round"
    bench "25M fp32 8x128" --layers 8 --width 512 --heads 8 --context 128 --per-rank 8
    if [[ $round == 1 ]]; then
        ZERODP_CUDA_KERNELS=0 bench "25M fp32 8x128, candle's composite ops" --layers 8 --width 512 --heads 8 --context 128 --per-rank 8
    fi
    peer "25M fp32 8x128" --layers 8 --width 512 --heads 8 --context 128 --batch 8 --dtype fp32
    bench "12x768 bf16 64x128" --layers 12 --width 768 --heads 12 --context 128 --per-rank 64 --precision bf16
    if [[ $round == 1 ]]; then
        ZERODP_CUDA_KERNELS=0 bench "12x768 bf16 64x128, candle's composite ops" --layers 12 --width 768 --heads 12 --context 128 --per-rank 64 --precision bf16
    fi
    peer "12x768 bf16 64x128" --layers 12 --width 768 --heads 12 --context 128 --batch 64 --dtype bf16
done
# CAPACITY=1: ZeRO-Offload's case, the 10.2B GPT of examples/gpu_offload_10b.json for 3 steps (about
# 5 minutes on an H200 with 16 cores; needs about 130 GB of host memory), with the GPU's memory
# sampled every second for its peak and each step's phases (the CPU Adam's share is `optimizer`).
if [[ "${CAPACITY:-0}" == 1 ]]; then
    echo "== capacity: 10.2B GPT, bf16, stage 2, offload_optimizer cpu, 3 steps"
    python3 -c 'import random; random.seed(1); w="the of and to in a is that for it as was with be by on not".split(); open("/tmp/corpus.txt","w").write(" ".join(random.choice(w) for _ in range(600000)))'
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 > /tmp/gpu_mem.log &
    SAMPLER=$!
    /usr/bin/time -v timeout 420 "$DIR/zerodp" train --config "$DIR/gpu_offload_10b.json" --layers 40 --width 4608 --heads 36 --context 128 --device cuda --steps 3 --no-progress --data /tmp/corpus.txt --metrics /tmp/cap.jsonl > /tmp/cap.log 2>&1
    echo "rc=$?"
    kill "$SAMPLER" 2>/dev/null
    grep -E "error|GPU memory|optimizer:|Maximum resident|Elapsed" /tmp/cap.log | head -8
    echo "GPU peak MiB: $(sort -n /tmp/gpu_mem.log | tail -1)"
    python3 - <<'PY'
import json
for line in open("/tmp/cap.jsonl"):
    m = json.loads(line)
    p = m["phase_s"]
    print(f'step {m["step"]}: loss {m["loss"]:.3f}, {m["tokens_per_s"]:.1f} tok/s, {m["step_time_s"]:.1f} s: '
          f'forward {p["forward"]:.1f}, backward {p["backward"]:.1f}, comm {p["comm"]:.1f}, '
          f'optimizer (CPU Adam) {p["optimizer"]:.1f} s = {p["optimizer"] / m["step_time_s"]:.0%}')
PY
fi
