#!/usr/bin/env bash
# The 16-core checks of docs/benchmarks.md, "On a many-core server (16 cores)", as one script for a machine with
# many cores and no Rust (the GPU test machine's Xeon): zerodp against PyTorch at every ranks x
# threads split, one rank's scaling from 2 to all cores, the per-op scaling table over the same
# span, and the collectives at 8 ranks beside STREAM. Prepare on the build machine:
#
#   cargo build --release && mkdir -p DIR && strip -o DIR/zerodp target/release/zerodp
#   cp -r ../shared/peers DIR/peers && cp scripts/cores_check.sh DIR/
#   gcc -O3 -march=x86-64-v3 -fopenmp -static ../shared/peers/stream.c -o DIR/stream   # optional
#
# then on the many-core machine: `bash DIR/cores_check.sh DIR` (about 9 minutes on 16 cores; 45 s
# on 2 cores without the peers; everything printed to stdout). PyTorch must be importable by
# python3 there for the peers. SECTIONS picks parts:
# `SECTIONS="ops comm" bash DIR/cores_check.sh DIR` (default: peers rank ops comm stream).
set -uo pipefail
DIR="$(cd "${1:-$(dirname "$0")}" && pwd)"
Z="$DIR/zerodp"
N=$(nproc)
M25="--layers 8 --width 512 --heads 8 --context 128"
SECTIONS=${SECTIONS:-"peers rank ops comm stream"}
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
echo "== machine"; lscpu | grep -E 'Model name|^CPU\(s\)'; echo "amx: $(grep -o amx_tile /proc/cpuinfo | sort -u)"
"$Z" --version

if has peers; then
    echo "== zerodp against PyTorch at every split (peers/cores.sh, stage 0, fp32, 8 x 128 per rank)"
    # No outer timeout: the table is printed at the end (cores.sh times out each run itself).
    Z="$Z" PEERS="$DIR/peers" OUT=/tmp/cores_check bash "$DIR/peers/cores.sh" 2>&1 | tail -16
fi

if has rank; then
    echo "== one rank of the 25M GPT on 2 and on $N threads (goal at 16: at least 6x the 2 threads)"
    for cores in 2 "$N"; do
        echo -n "threads $cores: "
        taskset -c "0-$((cores - 1))" timeout 120 "$Z" bench train $M25 --world-sizes 1 --stages 0 \
            --warmup 2 --steps 3 --format json 2>&1 | grep -oE '"tokens_per_s": *[0-9.]+' | head -1
    done
fi

if has ops; then
    echo "== where a $N-thread rank loses: per-op scaling from 2 to $N threads"
    timeout 150 "$Z" bench ops $M25 --threads "2,$N" --project-threads "$N" --reps 3 --steps 3 2>&1 |
        tail -19
fi

if has comm; then
    echo "== collectives at 8 ranks: %mem is their memory traffic against the all-thread memcpy"
    timeout 90 "$Z" bench comm --world-size 8 --sizes 16M..256M --iters 3 2>&1 | grep -E '^#|64M|256M' 
fi

if has stream; then
    echo "== STREAM at 8 and $N threads"
    STREAM="$DIR/stream"
    if [[ ! -x "$STREAM" ]] && command -v gcc > /dev/null; then
        gcc -O3 -march=native -fopenmp "$DIR/peers/stream.c" -o /tmp/cores_check_stream && STREAM=/tmp/cores_check_stream
    fi
    if [[ -x "$STREAM" ]]; then
        for t in 8 "$N"; do
            echo "-- $t threads"
            OMP_NUM_THREADS=$t OMP_PROC_BIND=close timeout 60 "$STREAM" $((1 << 27)) 5 2>&1 | tail -5
        done
    else
        echo "no STREAM binary and no gcc: skipped"
    fi
fi
