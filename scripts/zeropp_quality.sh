#!/usr/bin/env bash
# ZeRO++'s quantization against the exact run: stage 3 on 4 in-process ranks, the same seed, data
# and steps, exact, with quantized weights (qwZ, `zero_quantized_weights`), and with all of ZeRO++
# ("all": hpZ over groups of 2 ranks standing for hosts, qwZ, and qgZ's two all-to-alls of
# quantized gradients, `zero_quantized_gradients`); prints the mean loss of the last 10 steps of
# each and its relative difference from the exact run.
#
#   scripts/zeropp_quality.sh                  # the 25M GPT for 300 steps, GPT-2 small's shape for 50
#   CORPUS=path scripts/zeropp_quality.sh      # default data/corpus.txt (scripts/fetch_corpus.sh)
#   VARIANTS="exact all" scripts/zeropp_quality.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${ZERODP_BIN:-target/release/zerodp}
corpus=${CORPUS:-data/corpus.txt}
[[ -f $corpus ]] || { echo "no corpus at $corpus: run scripts/fetch_corpus.sh" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

variants=(${VARIANTS:-exact qwZ all})
for v in exact qwZ all; do
    case $v in
        exact) keys='"zero_quantized_weights": false' ;;
        qwZ) keys='"zero_quantized_weights": true' ;;
        all) keys='"zero_hpz_partition_size": 2, "zero_quantized_weights": true, "zero_quantized_gradients": true' ;;
    esac
    cat > "$work/s3-$v.json" <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "weight_decay": 0.1}},
 "zero_optimization": {"stage": 3, $keys}}
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
printf '%-18s %6s %8s %12s %10s\n' model steps run "last 10" "vs exact"
for entry in "${models[@]}"; do
    IFS='|' read -r name steps flags <<< "$entry"
    read -r -a model_args <<< "$flags"
    exact=""
    for v in "${variants[@]}"; do
        m="$work/m-$v.jsonl"
        "$bin" train --config "$work/s3-$v.json" --world-size 4 "${model_args[@]}" \
            --steps "$steps" --seed 3 --no-progress --data "$corpus" --metrics "$m" 2>/dev/null
        loss=$(last10 "$m")
        [[ $v == exact ]] && exact=$loss
        diff=$(awk -v a="$exact" -v b="$loss" 'BEGIN { if (a == "") print "-"; else printf "%+.3f%%", 100 * (b - a) / a }')
        printf '%-18s %6s %8s %12.5f %10s\n' "$name" "$steps" "$v" "$loss" "$diff"
    done
done
