#!/usr/bin/env bash
# The pre-flight check's plan against the process's real peak resident set, per rank.
#
#   scripts/preflight_rss.sh            # the whole grid: 144 runs, a few minutes on 2 cores
#   scripts/preflight_rss.sh --quick    # world size 2, stages 0 and 3 only
#
# For every case of the grid (models demo, small and a 25M-parameter GPT of 8 layers x width 512, or
# with MODELS=qwen a 20M-parameter Qwen2-shaped decoder;
# ZeRO stages 0-3; world sizes 1, 2, 4; fp32 and bf16; with and without activation checkpointing)
# it runs `zerodp train --steps 3` on a 1 MB generated text (micro-batches of 4 sequences, 2 for the
# 25M and Qwen models, whose compute dominates the run time) and prints the pre-flight's planned bytes per rank, the measured peak resident set per rank (the
# kernel's VmHWM of the whole process, which holds every rank, over the world size) and their ratio.
# Each case runs RUNS times (default 3): the plan is the same every run, the peak resident set
# moves with the allocator and the threads' timing, so the median is compared and the spread
# (highest over lowest measured, minus one) printed beside it. The last lines give the lowest and
# highest ratio and the widest spread; the script exits 1 when a ratio falls outside [0.90, 1.10].
#
# ZERODP_BIN=path runs that binary; otherwise the release binary is built and copied aside first (a
# shared target directory may be rebuilt by someone else while the grid runs).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
[[ "${1:-}" == "--quick" ]] && quick=1
runs=${RUNS:-3}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

bin=${ZERODP_BIN:-}
if [[ -z "$bin" ]]; then
    cargo build --release --quiet
    target=${CARGO_TARGET_DIR:-target}
    cp "$target/release/zerodp" "$work/zerodp"
    bin="$work/zerodp"
fi

# 1 MB of deterministic text (bytes are tokens; the content does not matter for memory).
awk 'BEGIN { srand(7); split("the of and to in a is that for it as was with be by on not he this are or from at which but have an they you were her she there one all we their", w, " ");
     n = 0; while (n < 1000000) { s = w[int(rand() * 40) + 1] " "; printf "%s", s; n += length(s) } }' \
    | head -c 1000000 > "$work/corpus.txt"

# A Qwen2-shaped decoder (grouped-query attention, q/k/v biases, a gated MLP, tied head) of 20M
# parameters, for the Llama family's rules.
cat > "$work/qwen.json" <<'EOF'
{"model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
 "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 16384,
 "max_position_embeddings": 512, "tie_word_embeddings": true, "rms_norm_eps": 1e-6}
EOF

# name|sequences per micro-batch|model flags. MODELS names those to run: the GPTs by default,
# MODELS=qwen for the Llama family's grid.
models=("demo|4|--model demo" "small|4|--model small" "25m|2|--model demo --layers 8 --width 512"
        "qwen|2|--model-config $work/qwen.json --context 256")
kept=()
for entry in "${models[@]}"; do
    [[ " ${MODELS:-demo small 25m} " == *" ${entry%%|*} "* ]] && kept+=("$entry")
done
models=("${kept[@]}")
stages=(0 1 2 3)
worlds=(1 2 4)
if [[ $quick == 1 ]]; then
    stages=(0 3)
    worlds=(2)
fi

# "12.34 MB", "1.234 GB", "56.7 KiB" ... -> bytes
to_bytes() {
    awk -v n="$1" -v u="$2" 'BEGIN {
        m["KB"] = 1e3; m["MB"] = 1e6; m["GB"] = 1e9;
        m["KiB"] = 1024; m["MiB"] = 1048576; m["GiB"] = 1073741824;
        printf "%.0f", n * m[u] }'
}

printf '%-6s %-5s %-5s %-5s %-6s %-5s %14s %14s %7s %7s\n' model micro stage world dtype ckpt planned/rank measured/rank ratio spread
lo=""
hi=""
widest=0
worst_case=""
fail=0
start=$(date +%s)
for entry in "${models[@]}"; do
    IFS='|' read -r name micro flags <<< "$entry"
    read -r -a model_args <<< "$flags"
    for stage in "${stages[@]}"; do
        for dtype in fp32 bf16; do
            for world in "${worlds[@]}"; do
                config="$work/ds_${stage}_${dtype}_${world}_${micro}.json"
                mixed=""
                [[ $dtype == bf16 ]] && mixed=', "bf16": {"enabled": true}'
                printf '{"train_batch_size": %d, "train_micro_batch_size_per_gpu": %d, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": %d}%s}\n' \
                    $((micro * world)) "$micro" "$stage" "$mixed" > "$config"
                for ckpt in no yes; do
                    extra=()
                    [[ $ckpt == yes ]] && extra=(--checkpoint-activations)
                    samples=()
                    for ((run = 0; run < runs; run++)); do
                        if ! out=$("$bin" train --config "$config" --world-size "$world" "${model_args[@]}" \
                            --steps 3 --no-progress --data "$work/corpus.txt" "${extra[@]}" 2>&1); then
                            echo "$name stage $stage world $world $dtype ckpt $ckpt failed:" >&2
                            echo "$out" >&2
                            exit 2
                        fi
                        planned=$(sed -n 's/^pre-flight: ZeRO stage [0-9] needs \([0-9.]*\) \([KMG]B\) per rank.*/\1 \2/p' <<< "$out")
                        measured=$(sed -n 's/^process peak resident set: \([0-9.]*\) \([KMG]i\{0,1\}B\) .*/\1 \2/p' <<< "$out")
                        if [[ -z "$planned" || -z "$measured" ]]; then
                            echo "could not read the plan or the peak resident set from:" >&2
                            echo "$out" >&2
                            exit 2
                        fi
                        samples+=("$(to_bytes $measured)")
                    done
                    read -r median spread < <(printf '%s\n' "${samples[@]}" | sort -n | awk '
                        { v[NR] = $1 } END { printf "%s %.3f\n", v[int((NR + 1) / 2)], v[NR] / v[1] - 1 }')
                    p=$(to_bytes $planned)
                    m=$(( median / world ))
                    ratio=$(awk -v p="$p" -v m="$m" 'BEGIN { printf "%.3f", p / m }')
                    printf '%-6s %-5s %-5s %-5s %-6s %-5s %11.2f MB %11.2f MB %7s %7s\n' "$name" "$micro" "$stage" "$world" "$dtype" "$ckpt" \
                        "$(awk -v b="$p" 'BEGIN { print b / 1e6 }')" "$(awk -v b="$m" 'BEGIN { print b / 1e6 }')" "$ratio" "$spread"
                    if awk -v a="$spread" -v b="$widest" 'BEGIN { exit !(a > b) }'; then widest=$spread; fi
                    if [[ -z "$lo" ]] || awk -v a="$ratio" -v b="$lo" 'BEGIN { exit !(a < b) }'; then lo=$ratio; fi
                    if [[ -z "$hi" ]] || awk -v a="$ratio" -v b="$hi" 'BEGIN { exit !(a > b) }'; then hi=$ratio; fi
                    if awk -v r="$ratio" 'BEGIN { exit !(r < 0.90 || r > 1.10) }'; then
                        fail=1
                        worst_case="$worst_case $name/stage$stage/world$world/$dtype/ckpt-$ckpt=$ratio"
                    fi
                done
            done
        done
    done
done
echo "lowest planned/measured ratio: $lo"
echo "highest planned/measured ratio: $hi"
echo "widest spread of the peak resident set over $runs runs: $widest"
echo "grid time: $(( $(date +%s) - start )) s"
if [[ $fail == 1 ]]; then
    echo "outside [0.90, 1.10]:$worst_case"
    exit 1
fi
