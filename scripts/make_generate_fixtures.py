#!/usr/bin/env python3
"""Greedy-generation fixtures (issue 44): what `transformers`' `generate(do_sample=False)` writes
after a fixed prompt, for every tiny model directory under tests/fixtures/hf.

    python scripts/make_generate_fixtures.py [--out tests/fixtures/hf/generate-expected.json]

For each model (random weights, f32, eager attention) the prompt is 6 seeded token ids (none of
them the EOS id 0) and the continuation is 24 tokens, with stopping at the EOS switched off so
that the run is as long as the positions allow (32). The sliding-window families (mistral-tiny,
qwen2-tiny: window 8) decode far past their window. Besides the ids the file records, per model,
the smallest gap between the best and the second-best logit over the steps: a gap far above
f32's rounding is what makes a token-for-token comparison meaningful.

`cargo test --test it model::generate` reads it; it needs no Python.
Needs: pip install torch transformers safetensors
"""

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM

MODELS = ["gpt2-tiny", "gpt2-fields-tiny", "llama-tiny", "llama-bias-tiny", "mistral-tiny",
          "qwen2-tiny", "qwen3-tiny", "gemma-tiny"]
NEW_TOKENS = 24


def main():
    here = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "hf")
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(here, "generate-expected.json"))
    args = p.parse_args()
    out = {"new_tokens": NEW_TOKENS, "torch": torch.__version__, "models": {}}
    for i, name in enumerate(MODELS):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(here, name), dtype=torch.float32, attn_implementation="eager")
        model.eval()
        g = torch.Generator().manual_seed(100 + i)
        prompt = torch.randint(1, model.config.vocab_size, (1, 6), generator=g)
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        with torch.no_grad():
            r = model.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, output_scores=True,
                               return_dict_in_generate=True)
        gaps = []
        for s in r.scores:
            top = torch.topk(s[0].float(), 2).values
            gaps.append(float(top[0] - top[1]))
        out["models"][name] = {
            "prompt": prompt[0].tolist(),
            "greedy": r.sequences[0, 6:].tolist(),
            "min_top2_gap": min(gaps),
        }
        print(name, out["models"][name]["greedy"], f"gap {min(gaps):.2e}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
