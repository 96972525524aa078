#!/usr/bin/env bash
# ZeRO++ on slow links: plain stage 3 against hpZ (`zero_hpz_partition_size: "auto"`), hpZ with
# qwZ (`zero_quantized_weights`) and all three with qgZ (`zero_quantized_gradients`) across two
# namespace hosts of two ranks each (scripts/netns_hosts.sh), the link between them held to a rate
# by tc's tbf. For each rate and each run: the median step time and tokens/s, the bytes rank 0
# sends to the other host per step (the counters' `inter_host_sent_bytes`), and the share of the
# step rank 0 spent in communication (`phase_s.comm`).
#
#   scripts/zeropp_netns.sh                  # rates 1gbit and 10gbit
#   RATES="200mbit 2gbit" STEPS=6 scripts/zeropp_netns.sh
#
# Needs root, iproute2 with tc (the tbf qdisc), Open MPI, python3, and an MPI build:
# `cargo build --release --features mpi` (ZERODP_BIN=path for another binary). The model is the
# 25M GPT (8 layers, width 512) with one sequence of 128 tokens per rank, fp32,
# `stage3_max_reuse_distance` REUSE (default 0).
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${ZERODP_BIN:-target/release/zerodp}
rates=${RATES:-1gbit 10gbit}
steps=${STEPS:-8}
# 0: every unit is gathered again for its backward (strict ZeRO-3, the memory-lean setting where
# hpZ acts); a large value keeps each unit's forward graph and its gathered weights instead.
reuse=${REUSE:-0}
work=$(mktemp -d)
cleanup() {
    scripts/netns_hosts.sh down >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

cp "$bin" "$work/zerodp"
awk 'BEGIN { srand(7); split("the of and to in a is that for it as was with be by on not he this are or from at which but", w, " ");
     n = 0; while (n < 300000) { s = w[int(rand() * 24) + 1] " "; printf "%s", s; n += length(s) } }' > "$work/corpus.txt"
# name|zero_hpz_partition_size|zero_quantized_weights|zero_quantized_gradients
runs=("plain|1|false|false" "hpZ|\"auto\"|false|false" "hpZ+qwZ|\"auto\"|true|false"
    "+qgZ|\"auto\"|true|true")
for entry in "${runs[@]}"; do
    IFS='|' read -r name hpz qwz qgz <<< "$entry"
    cat > "$work/s3-$name.json" <<JSON
{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
 "zero_optimization": {"stage": 3, "zero_hpz_partition_size": $hpz,
   "zero_quantized_weights": $qwz, "zero_quantized_gradients": $qgz,
   "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": $reuse}}
JSON
done

scripts/netns_hosts.sh down >/dev/null 2>&1 || true
scripts/netns_hosts.sh up >/dev/null

summary() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, statistics, sys
path, rate, run = sys.argv[1], sys.argv[2], sys.argv[3]
lines = [json.loads(l) for l in open(path) if l.strip()]
later = lines[1:] or lines
step = statistics.median(l["step_time_s"] for l in later)
comm = statistics.median(l["phase_s"]["comm"] for l in later)
inter = statistics.median(sum(l["inter_host_sent_bytes"].values()) for l in later)
tokens = 4 * 128
print(f"{rate:>8} {run:>8} {step * 1e3:10.0f} {tokens / step:9.0f} {inter / 1e6:14.2f} {comm / step:8.0%}")
PY
}

printf '%8s %8s %10s %9s %14s %8s\n' rate run "step ms" tokens/s "inter MB/step" comm
for rate in $rates; do
    for ns in zdp-h1 zdp-h2; do
        dev=zdp-v${ns#zdp-h}
        ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst 512kb latency 400ms
    done
    for entry in "${runs[@]}"; do
        name=${entry%%|*}
        metrics="$work/m-$rate-$name.jsonl"
        if ! out=$(scripts/netns_hosts.sh run 2 "$work/zerodp" train --config "$work/s3-$name.json" \
            --model demo --layers 8 --width 512 --steps "$steps" --no-progress \
            --data "$work/corpus.txt" --metrics "$metrics" 2>&1); then
            echo "$rate $name failed:" >&2
            echo "$out" >&2
            exit 2
        fi
        summary "$metrics" "$rate" "$name"
    done
done
