#!/usr/bin/env bash
# Losses of zerodp against plain PyTorch on the same initial weights and data (fp32, 10 steps):
# builds the weights with PyTorch's init, trains them with `zerodp train` at world size 2 (stage
# $STAGE, default 0) and with ../shared/peers/torch_gpt.py, and prints the largest loss difference.
# Needs the peers' venv (../shared/peers/README.md) as $PY (default /tmp/peers/venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/tmp/peers/venv/bin/python}
BIN=${BIN:-target/release/zerodp}
PEERS=${PEERS:-../shared/peers}
STAGE=${STAGE:-0}
STEPS=${STEPS:-10}
LR=${LR:-1e-4}
LAYERS=${LAYERS:-4} WIDTH=${WIDTH:-256} HEADS=${HEADS:-4} CONTEXT=${CONTEXT:-128}
BATCH=16 # windows per step = train_batch_size (2 ranks x 8)
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT

# The corpus: exactly BATCH windows of CONTEXT+1 bytes of English-like ASCII.
"$PY" - "$D/corpus.txt" $((BATCH * (CONTEXT + 1))) <<'PYEOF'
import sys
words = "the of and to in is that for it as with was on be by at this are from or an which".split()
out, i = [], 0
while sum(len(w) + 1 for w in out) < int(sys.argv[2]):
    out.append(words[(i * 7 + i // 3) % len(words)]); i += 1
open(sys.argv[1], "w").write((" ".join(out))[: int(sys.argv[2])])
PYEOF

# Initial weights drawn by PyTorch, saved under zerodp's names.
"$PY" - "$PEERS" "$D/init.safetensors" "$LAYERS" "$WIDTH" "$HEADS" "$CONTEXT" <<'PYEOF'
import sys; sys.path.insert(0, sys.argv[1])
import torch; from safetensors.torch import save_file; import torch_gpt
torch.manual_seed(0)
L, C, H, T = map(int, sys.argv[3:7])
m = torch_gpt.GPT(256, T, L, C, H)
with torch.no_grad():  # GPT-2's initialisation (zerodp's own): N(0, 0.02) matrices, LN 1/0, biases 0
    for name, p in m.named_parameters():
        if p.dim() >= 2: p.normal_(0.0, 0.02)
        elif "ln" in name and name.endswith("weight"): p.fill_(1.0)
        else: p.zero_()
save_file({k: v.detach().contiguous() for k, v in m.state_dict().items()}, sys.argv[2])
PYEOF

cat > "$D/ds.json" <<JSON
{"train_batch_size": $BATCH, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": $LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
 "zero_optimization": {"stage": $STAGE}}
JSON
"$BIN" train --config "$D/ds.json" --world-size 2 --backend inprocess --layers "$LAYERS" \
  --width "$WIDTH" --heads "$HEADS" --context "$CONTEXT" --data "$D/corpus.txt" \
  --init "$D/init.safetensors" --steps "$STEPS" --metrics "$D/zerodp.jsonl" --no-progress >/dev/null
"$PY" "$PEERS/torch_gpt.py" --weights "$D/init.safetensors" --corpus "$D/corpus.txt" \
  --layers "$LAYERS" --width "$WIDTH" --heads "$HEADS" --context "$CONTEXT" --steps "$STEPS" --lr "$LR" \
  --threads 2 --metrics "$D/torch.jsonl"
# The noise floor: PyTorch against itself with the windows in reverse order (the same sums in
# another order).
"$PY" "$PEERS/torch_gpt.py" --weights "$D/init.safetensors" --corpus "$D/corpus.txt" \
  --layers "$LAYERS" --width "$WIDTH" --heads "$HEADS" --context "$CONTEXT" --steps "$STEPS" --lr "$LR" \
  --threads 2 --order reversed --metrics "$D/torch_reversed.jsonl"
"$PY" - "$D/torch_reversed.jsonl" "$D/torch.jsonl" <<'PYEOF'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
print(f"noise floor (PyTorch, windows reversed, against PyTorch): {max(abs(x - y) for x, y in zip(a, b)):.2e}")
PYEOF
"$PY" - "$D/zerodp.jsonl" "$D/torch.jsonl" <<'PYEOF'
import json, sys
z = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
t = [json.loads(l) for l in open(sys.argv[2])]
z = [r for r in z if "step" in r and "loss" in r and r.get("rank", 0) == 0]
worst = worst_rel = 0.0
for a, b in zip(z, t):
    d = abs(a["loss"] - b["loss"]); rel = d / abs(b["loss"])
    worst, worst_rel = max(worst, d), max(worst_rel, rel)
    print(f'step {b["step"]:3d}  zerodp {a["loss"]:.7f}  torch {b["loss"]:.7f}  diff {d:.2e} (relative {rel:.1e})')
print(f"largest loss difference over {len(t)} steps: {worst:.2e} absolute, {worst_rel:.1e} relative")
PYEOF
