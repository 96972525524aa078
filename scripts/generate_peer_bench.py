#!/usr/bin/env python3
"""Generation speed, zerodp against transformers' `generate`, side by side on this CPU (issue 44).

    python scripts/generate_peer_bench.py [--arch gpt2|llama] [--new 128] [--prompt 32] [--rounds 2]

Writes a model directory of random weights (GPT-2 small's shape: 12 layers, width 768, 12
heads, vocabulary 50257; or a Llama of 12 layers, width 768, 12 heads, 4 key/value heads,
intermediate 2048, vocabulary 32000) into a temporary directory, then alternates
`transformers`' greedy `generate` (f32, eager attention, a KV cache, torch's threads = the
cores) and `zerodp generate` (release build, `target/release/zerodp`) on the same prompt for
`--rounds` rounds, each writing exactly `--new` tokens (no stop token). The prompt is the bytes
of an ASCII text, the same ids on both sides (the directory has no tokenizer, so zerodp reads
bytes as tokens). Prints the tokens/s of each round and the ratio of the medians: both sides
timed over the generation alone (the prompt's pass and the new tokens; transformers' `generate`
call, zerodp's own report of its prompt pass and steps), and zerodp's whole process beside it.

Needs: pip install torch transformers safetensors
"""

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def make(arch, path):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                          num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                          max_position_embeddings=1024, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--zerodp", default="target/release/zerodp")
    a = p.parse_args()
    cores = os.cpu_count()
    torch.set_num_threads(cores)
    text = ("The quick brown fox jumps over the lazy dog. " * 8)[: a.prompt]
    ids = torch.tensor([list(text.encode())])
    with tempfile.TemporaryDirectory() as d:
        model = make(a.arch, d)
        model = model.__class__.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        torch_rates, zerodp_rates = [], []
        for r in range(a.rounds):
            with torch.no_grad():
                t = time.perf_counter()
                out = model.generate(ids, do_sample=False, max_new_tokens=a.new,
                                     min_new_tokens=a.new)
                dt = time.perf_counter() - t
            assert out.shape[1] == ids.shape[1] + a.new
            torch_rates.append(a.new / dt)
            cmd = [a.zerodp, "generate", "--model-dir", d, "--prompt", text,
                   "--max-new-tokens", str(a.new)]
            t = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            dt = time.perf_counter() - t
            # The generation alone, as transformers' generate call is timed: the prompt's pass plus
            # the steps (zerodp reports both on stderr); the process start and weight load apart.
            m = re.search(r"prompt tokens in ([0-9.]+) s, (\d+) new tokens at ([0-9.]+) tokens/s",
                          res.stderr)
            prompt_s, n, rate = float(m.group(1)), int(m.group(2)), float(m.group(3))
            gen_s = prompt_s + (n - 1) / rate
            zerodp_rates.append(n / gen_s)
            print(f"round {r}: transformers generate {torch_rates[-1]:.1f} tokens/s, zerodp "
                  f"generate {zerodp_rates[-1]:.1f} tokens/s (its whole process, loading "
                  f"included: {a.new / dt:.1f})")
        t, z = statistics.median(torch_rates), statistics.median(zerodp_rates)
        print(f"{a.arch}, {a.prompt} prompt + {a.new} new tokens, {cores} cores: transformers "
              f"{t:.1f}, zerodp {z:.1f} tokens/s: {z / t:.2f}x")


if __name__ == "__main__":
    main()
