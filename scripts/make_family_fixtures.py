#!/usr/bin/env python3
"""Hugging Face parity fixtures of the Llama-decoder families (issue 43).

    python scripts/make_family_fixtures.py [--out tests/fixtures/hf]

For each family a tiny model with random weights is written by `transformers`
(`save_pretrained`: config.json and model.safetensors) to OUT/<name>/, and beside it
OUT/<name>-expected.json: fixed token batches, and the losses and gradient norms (before
clipping) `transformers` computes on them in fp32 (eager attention) over 10 steps of torch.optim.AdamW with weight
decay on every parameter and clip_grad_norm_ at 1.0 (DeepSpeed's `gradient_clipping`):

* qwen2-tiny: Qwen2 (biases on q, k and v; grouped-query attention; tied head); a sliding window
  of 8 with `use_sliding_window` on the layers from `max_window_layers` 1 on: the 16-token batches
  are twice the window;
* qwen3-tiny: Qwen3 (RMSNorm of each head's queries and keys; head_dim 24 apart from the width
  64 / 4 heads; untied head);
* mistral-tiny: Mistral (sliding_window 8 on every layer, half the batches' 16 tokens);
* llama-bias-tiny: Llama with `attention_bias`, `mlp_bias` and yarn rope scaling (factor 4 over
  an original context of 8, so that both ends of its ramp and its attention factor apply);
* gpt2-fields-tiny: GPT-2 with the fields zerodp once refused: `layer_norm_epsilon` 1e-6, `n_inner`
  96 (1.5 x the width) and an untied head;
* gemma-tiny: Gemma (GeGLU with the tanh GELU, RMSNorm scaled by 1 + weight, the embeddings
  scaled by sqrt(64), head_dim 24 apart from the width, a tied head).

`--only NAME` writes one of them (the others keep their bytes).

`cargo test --test it model::hf_families` reads them; it needs no Python.
Needs: pip install torch transformers safetensors numpy
"""

import argparse
import json
import os

import numpy as np
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SEED = 4321
BATCH = 4
SEQ = 16
STEPS = 10
CLIP = 1.0
OPTIM = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=0,
)


def families():
    return [
        (
            "qwen2-tiny",
            Qwen2ForCausalLM,
            Qwen2Config(
                **COMMON,
                tie_word_embeddings=True,
                use_sliding_window=True,
                sliding_window=8,
                max_window_layers=1,
            ),
        ),
        (
            "qwen3-tiny",
            Qwen3ForCausalLM,
            Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False),
        ),
        (
            "mistral-tiny",
            MistralForCausalLM,
            MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
        ),
        (
            "llama-bias-tiny",
            LlamaForCausalLM,
            LlamaConfig(
                **COMMON,
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 8,
                    "rope_theta": 10000.0,
                },
            ),
        ),
        (
            "gemma-tiny",
            GemmaForCausalLM,
            GemmaConfig(
                **{**COMMON, "hidden_act": "gelu_pytorch_tanh"},
                head_dim=24,
                tie_word_embeddings=True,
            ),
        ),
        (
            "gpt2-fields-tiny",
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=300,
                n_positions=32,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_inner=96,
                layer_norm_epsilon=1e-6,
                activation_function="gelu_new",
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=False,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
    ]


def randomize(model, gen):
    """Matrices normal(0, 0.1), biases normal(0, 0.1), norms 1 + normal(0, 0.1): far enough from
    transformers' start that a mix-up of any two tensors changes the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "gemma" in type(model).__name__.lower():
                # Gemma's norms scale by 1 + weight: weights around 0.
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def batches(vocab):
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(STEPS):
        seqs = rng.integers(0, vocab, size=(BATCH, SEQ + 1))
        out.append({"tokens": seqs[:, :-1].tolist(), "targets": seqs[:, 1:].tolist()})
    return out


def loss_of(model, batch):
    tokens = torch.tensor(batch["tokens"])
    targets = torch.tensor(batch["targets"])
    logits = model(input_ids=tokens).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
    )


def save_and_train(model, out_root, name):
    model_dir = os.path.join(out_root, name)
    model.save_pretrained(model_dir, safe_serialization=True)
    extra = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(extra):
        os.remove(extra)
    data = batches(model.config.vocab_size)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=OPTIM["lr"],
        betas=tuple(OPTIM["betas"]),
        eps=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"],
    )
    losses, norms = [], []
    for batch in data:
        opt.zero_grad()
        loss = loss_of(model, batch)
        losses.append(loss.item())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    with torch.no_grad():
        after = loss_of(model, data[0]).item()
    expected = {
        "model_dir": name,
        "batch": BATCH,
        "seq": SEQ,
        "optimizer": OPTIM,
        "gradient_clipping": CLIP,
        "steps": data,
        "losses": losses,
        "grad_norms": norms,
        "loss_after_steps_on_batch_0": after,
        "num_params": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    with open(os.path.join(out_root, f"{name}-expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"wrote {model_dir}; losses {losses[0]:.6f} .. {losses[-1]:.6f}; norm {norms[0]:.4f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="tests/fixtures/hf")
    p.add_argument("--only")
    a = p.parse_args()
    torch.set_num_threads(1)
    for k, (name, cls, config) in enumerate(families()):
        if a.only and name != a.only:
            continue
        torch.manual_seed(SEED + k)
        # Eager attention: the window as an explicit mask (what the issue checks against).
        config._attn_implementation = "eager"
        model = cls(config).float().eval()
        randomize(model, torch.Generator().manual_seed(SEED + k))
        save_and_train(model, a.out, name)


if __name__ == "__main__":
    main()
