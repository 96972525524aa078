#!/usr/bin/env bash
# ZeRO++'s quantized weights (qwZ) against the exact run: stage 3 on 4 in-process ranks, the same
# seed, data and steps, with and without `zero_quantized_weights`; prints the mean loss of the last
# 10 steps of each and their relative difference.
#
#   scripts/zeropp_quality.sh                  # the 25M GPT for 300 steps, GPT-2 small's shape for 50
#   CORPUS=path scripts/zeropp_quality.sh      # default data/corpus.txt (scripts/fetch_corpus.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${ZERODP_BIN:-target/release/zerodp}
corpus=${CORPUS:-data/corpus.txt}
[[ -f $corpus ]] || { echo "no corpus at $corpus: run scripts/fetch_corpus.sh" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for qwz in false true; do
    cat > "$work/s3-$qwz.json" <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "weight_decay": 0.1}},
 "zero_optimization": {"stage": 3, "zero_quantized_weights": $qwz}}
JSON
done

last10() {
    python3 - "$1" <<'PY'
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if l.strip()]
print(sum(losses[-10:]) / len(losses[-10:]))
PY
}

# name|steps|model flags
models=("25M GPT|300|--model demo --layers 8 --width 512" "GPT-2 small shape|50|--model demo --layers 12 --width 768 --heads 12 --context 128")
printf '%-18s %6s %12s %12s %10s\n' model steps exact qwZ difference
for entry in "${models[@]}"; do
    IFS='|' read -r name steps flags <<< "$entry"
    read -r -a model_args <<< "$flags"
    declare -A loss=()
    for qwz in false true; do
        m="$work/m-$qwz.jsonl"
        "$bin" train --config "$work/s3-$qwz.json" --world-size 4 "${model_args[@]}" \
            --steps "$steps" --seed 3 --no-progress --data "$corpus" --metrics "$m" 2>/dev/null
        loss[$qwz]=$(last10 "$m")
    done
    diff=$(awk -v a="${loss[false]}" -v b="${loss[true]}" 'BEGIN { d = (b - a) / a; printf "%+.3f%%", 100 * d }')
    printf '%-18s %6s %12.5f %12.5f %10s\n' "$name" "$steps" "${loss[false]}" "${loss[true]}" "$diff"
done
