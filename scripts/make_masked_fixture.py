#!/usr/bin/env python3
"""Masked-label fixture (issue 44): `transformers`' loss of the llama-tiny fixture on a batch whose
labels are -100 except on some tokens (the answers of chat data), as its Trainer computes a step
across devices: the sum of the trained tokens' cross-entropy over the global batch, divided by
their count. The targets are already shifted (target k is the token after input k), as zerodp's
batches hold them.

    python scripts/make_masked_fixture.py   # tests/fixtures/hf/llama-tiny-masked.json
Needs: pip install torch transformers safetensors
"""

import json
import os

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

here = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
model = AutoModelForCausalLM.from_pretrained(os.path.join(here, "llama-tiny"),
                                             dtype=torch.float32, attn_implementation="eager")
g = torch.Generator().manual_seed(7)
tokens = torch.randint(1, 300, (4, 16), generator=g)
targets = torch.randint(1, 300, (4, 16), generator=g)
# Row r trains on a different number of tokens: the last 3, 6, 9 and 12 positions.
for r in range(4):
    targets[r, : 16 - 3 * (r + 1)] = -100
with torch.no_grad():
    logits = model(tokens).logits.float()
total = F.cross_entropy(logits.reshape(-1, 300), targets.reshape(-1), ignore_index=-100,
                        reduction="sum")
count = int((targets != -100).sum())
out = {"tokens": tokens.tolist(), "targets": targets.tolist(), "loss": float(total / count),
       "trained": count}
with open(os.path.join(here, "llama-tiny-masked.json"), "w") as f:
    json.dump(out, f)
print(out["loss"], count)
