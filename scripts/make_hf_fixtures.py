#!/usr/bin/env python3
"""Hugging Face parity fixtures for zerodp (issue 31), and a check of zerodp's exports.

    python scripts/make_hf_fixtures.py make [--out tests/fixtures/hf]
    python scripts/make_hf_fixtures.py check EXPORT_DIR --consolidated FILE.safetensors

`make` writes a tiny GPT-2 (2 layers, width 64, 4 heads, vocabulary 300, 32 positions) with random
weights through `transformers` (`save_pretrained`: config.json and model.safetensors, Conv1D
weights [in, out], the tied lm_head left out) to OUT/gpt2-tiny/, and OUT/gpt2-tiny-expected.json:
fixed token batches and the losses `transformers` computes on them, in fp32, at step 0 and over
10 steps of torch.optim.AdamW (no warmup, constant learning rate, every parameter decayed, as
zerodp's AdamW decays every parameter); the same for a tiny Llama (grouped-query attention, 4
query heads on 2 key/value heads, an untied head) in OUT/llama-tiny/. `cargo test --test it model::hf_gpt2`
and `--test it model::hf_llama` read them; they need no Python.

`check` loads EXPORT_DIR (what `zerodp ckpt export` wrote) with AutoModelForCausalLM and compares
its logits on the fixture's tokens with a GPT-2 or Llama built here from FILE.safetensors (what
`zerodp ckpt consolidate` wrote from the same checkpoint, zerodp's own names and [out, in]
layout), mapped by this script's own code rather than zerodp's. Prints the max relative
difference and the loss on the step-0 batch; exits 1 above 1e-5.

Needs: pip install torch transformers safetensors
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

SEED = 1234
BATCH = 4  # sequences per step (the global batch)
SEQ = 16
STEPS = 10
OPTIM = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def tiny_config():
    return GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )


def randomize(model, gen):
    """GPT-2's normal(0, 0.02) weights, and LayerNorms and biases away from 1 and 0, so that a
    mix-up of any two tensors (or a missed transpose) changes the loss."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


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


def tiny_llama_config():
    """Grouped-query attention (4 query heads on 2 key/value heads) and an untied head."""
    return LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=0,
        eos_token_id=0,
    )


def randomize_llama(model, gen):
    """Matrices normal(0, 0.1) (large enough that attention is far from uniform, so that the
    rotation and the head grouping show in the loss), norms away from 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def make(out_root):
    torch.manual_seed(SEED)
    gpt2 = GPT2LMHeadModel(tiny_config()).float().eval()
    randomize(gpt2, torch.Generator().manual_seed(SEED))
    save_and_train(gpt2, out_root, "gpt2-tiny")
    llama = LlamaForCausalLM(tiny_llama_config()).float().eval()
    randomize_llama(llama, torch.Generator().manual_seed(SEED + 1))
    save_and_train(llama, out_root, "llama-tiny", llama_variants(llama))


# Config changes of the Llama fixture checked at step 0 on its own weights: the rotary scalings
# (original context 8 < the 16 tokens, so that llama3's ramp and its low band both apply) and a
# tied head (lm_head.weight dropped from the file).
LLAMA_VARIANTS = [
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
            "rope_theta": 10000.0,
        }
    },
    {"tie_word_embeddings": True},
]


def llama_variants(model):
    """Step-0 losses of the fixture's weights under each of LLAMA_VARIANTS (before training)."""
    data = batches(model.config.vocab_size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for change in LLAMA_VARIANTS:
        cfg = LlamaConfig(**{**model.config.to_dict(), **change})
        variant = LlamaForCausalLM(cfg).float().eval()
        drop = ["lm_head.weight"] if change.get("tie_word_embeddings") else []
        variant.load_state_dict({k: v for k, v in state.items() if k not in drop}, strict=not drop)
        if drop:
            variant.tie_weights()
            assert variant.lm_head.weight.data_ptr() == variant.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            loss = loss_of(variant, data[0]).item()
        out.append({"config": change, "drop": drop, "loss": loss})
    return out


def save_and_train(model, out_root, name, variants=None):
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
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = loss_of(model, batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = loss_of(model, data[0]).item()
    expected = {
        "model_dir": name,
        "batch": BATCH,
        "seq": SEQ,
        "optimizer": OPTIM,
        "steps": data,
        "losses": losses,
        "loss_after_steps_on_batch_0": after,
        "variants": variants or [],
        "torch": torch.__version__,
    }
    with open(os.path.join(out_root, f"{name}-expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"wrote {model_dir}; losses {losses[0]:.6f} .. {losses[-1]:.6f}")


def from_consolidated(path, config):
    """The export's model class from zerodp's own names and layout, mapped independently of
    zerodp: GPT-2's Conv1D weights transposed and prefixed, Llama's names as they are."""
    state = load_file(path)
    if config.model_type != "gpt2":
        # The Llama and the families on its decoder (qwen2, qwen3, mistral, gemma): the names are
        # Hugging Face's already.
        hf = {name: t.float() for name, t in state.items()}
        if config.tie_word_embeddings:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        model = AutoModelForCausalLM.from_config(config).float().eval()
        model.load_state_dict(hf, strict=True)
        return model
    hf = {}
    for name, t in state.items():
        t = t.float()
        if any(name.endswith(s) for s in ("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.t().contiguous()
        hf[name if name == "lm_head.weight" else "transformer." + name] = t
    if config.tie_word_embeddings:
        hf["lm_head.weight"] = hf["transformer.wte.weight"]
    model = GPT2LMHeadModel(config).float().eval()
    missing, unexpected = model.load_state_dict(hf, strict=False)
    missing = [m for m in missing if not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        sys.exit(f"consolidated file does not map: missing {missing}, unexpected {unexpected}")
    return model


def check(export_dir, consolidated, expected_path):
    with open(expected_path) as f:
        expected = json.load(f)
    batch = expected["steps"][0]
    exported = AutoModelForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32).eval()
    reference = from_consolidated(consolidated, exported.config)
    tokens = torch.tensor(batch["tokens"])
    with torch.no_grad():
        a = exported(input_ids=tokens).logits
        b = reference(input_ids=tokens).logits
        rel = ((a - b).abs().max() / b.abs().max()).item()
        loss = loss_of(exported, batch).item()
    print(f"export {export_dir}: {type(exported).__name__}, dtype {exported.dtype}")
    print(f"logits max |export - consolidated| / max |consolidated| = {rel:.3e}")
    print(f"loss on the step-0 batch: {loss:.8f}")
    if rel > 1e-5:
        sys.exit("logits differ by more than 1e-5")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default="tests/fixtures/hf")
    c = sub.add_parser("check")
    c.add_argument("export_dir")
    c.add_argument("--consolidated", required=True)
    c.add_argument("--expected", default="tests/fixtures/hf/gpt2-tiny-expected.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.mode == "make":
        make(a.out)
    else:
        check(a.export_dir, a.consolidated, a.expected)


if __name__ == "__main__":
    main()
