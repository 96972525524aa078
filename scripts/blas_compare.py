#!/usr/bin/env python3
"""The GPT's linear layers on zerodp's GEMM (the `gemm` crate) against OpenBLAS and MKL, one thread.

Issue 15 asks to choose the matrix-multiply library by measurement, for the shapes of the
benchmark models and one thread per rank. This runs, in interleaved rounds:

* `zerodp bench ops --format json` (each linear layer's forward `x @ w^T + b` and backward
  `dy @ w`, `dy^T @ x`, `sum(dy)` exactly as the model runs them), and
* the same three products in NumPy (its wheel bundles OpenBLAS, `DYNAMIC_ARCH`, the Haswell/Zen
  kernels here) and in PyTorch (MKL), with one thread each,

and prints GFLOP/s per layer and direction, medians over the rounds.

Usage (from the project root, after `cargo build --release`; the peers' venv has numpy and torch):
    /tmp/peers/venv/bin/python scripts/blas_compare.py [--rounds 3] [--model small |
        --layers 8 --width 512 --heads 8] [--zerodp target/release/zerodp]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

LAYERS = {  # bench ops row name -> (in, out) as multiples of the width
    "linear qkv (c -> 3c)": (1, 3),
    "linear proj (c -> c)": (1, 1),
    "linear fc (c -> 4c)": (1, 4),
    "linear fc2 (4c -> c)": (4, 1),
}


def best_seconds(f, reps):
    f()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def peer_rates(lib, n, inp, out, reps):
    """(forward, backward) GFLOP/s of one linear layer: 2·n·in·out forward, twice that backward."""
    if lib == "openblas":
        x, w, b = (np.random.rand(n, inp).astype(np.float32), np.random.rand(out, inp).astype(np.float32),
                   np.random.rand(out).astype(np.float32))
        dy = np.random.rand(n, out).astype(np.float32)
        fwd = lambda: x @ w.T + b  # noqa: E731
        bwd = lambda: (dy @ w, dy.T @ x, dy.sum(0))  # noqa: E731
    else:
        x, w, b = torch.rand(n, inp), torch.rand(out, inp), torch.rand(out)
        dy = torch.rand(n, out)
        fwd = lambda: torch.addmm(b, x, w.t())  # noqa: E731
        bwd = lambda: (dy @ w, dy.t() @ x, dy.sum(0))  # noqa: E731
    flops = 2.0 * n * inp * out
    return flops / best_seconds(fwd, reps) / 1e9, 2 * flops / best_seconds(bwd, reps) / 1e9


def zerodp_rates(binary, model_args, reps):
    out = subprocess.run([binary, "bench", "ops", *model_args, "--reps", str(reps), "--steps", "1",
                          "--format", "json"], check=True, capture_output=True, text=True).stdout
    rows = {r["op"]: r for r in json.loads(out)["ops"]}
    return {name: (rows[name]["forward_flops"] / rows[name]["forward_ms"] / 1e6,
                   rows[name]["backward_flops"] / rows[name]["backward_ms"] / 1e6) for name in LAYERS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zerodp", default="target/release/zerodp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--per-rank", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    a = ap.parse_args()
    if a.layers:
        model_args = ["--layers", str(a.layers), "--width", str(a.width), "--heads", str(a.heads),
                      "--context", str(a.context)]
        width = a.width
    else:
        model_args = ["--model", a.model or "small"]
        width = 256 if (a.model or "small") == "small" else 128
    model_args += ["--per-rank", str(a.per_rank)]
    n = a.per_rank * a.context
    results = {lib: {k: [] for k in LAYERS} for lib in ("zerodp", "openblas", "mkl")}
    for r in range(a.rounds):
        for name, rates in zerodp_rates(a.zerodp, model_args, a.reps).items():
            results["zerodp"][name].append(rates)
        for lib in ("openblas", "mkl"):
            for name, (i, o) in LAYERS.items():
                results[lib][name].append(peer_rates(lib, n, i * width, o * width, a.reps))
        print(f"round {r + 1} of {a.rounds} done", flush=True)
    print(f"\n{n} rows, width {width}, 1 thread, GFLOP/s, medians of {a.rounds} rounds")
    print(f"{'layer':<24}" + "".join(f"{lib + ' ' + d:>14}" for lib in results for d in ("fwd", "bwd")))
    for name in LAYERS:
        cells = []
        for lib in results:
            samples = results[lib][name]
            cells += [statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)]
        print(f"{name:<24}" + "".join(f"{c:>14.1f}" for c in cells))


if __name__ == "__main__":
    main()
