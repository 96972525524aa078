"""PyTorch eager beside `zerodp bench train --device cuda`: zerodp's GPT (the peers' torch_gpt.py,
`--peers DIR`) trained on one GPU with torch.optim.AdamW (fused), `--batch` x `--context` random
byte tokens per step, in fp32 (TF32 off unless `--tf32`) or under bf16 autocast. Prints one JSON
line: tokens/s over the timed steps (tokens / median step, each step ended by a synchronize) and the
GPU's peak allocated bytes.

  python3 scripts/gpu_peer_bench.py --peers ../shared/peers --layers 12 --width 768 --heads 12 \
      --context 128 --batch 64 --dtype bf16
"""
import argparse, json, statistics, sys, time

p = argparse.ArgumentParser()
p.add_argument("--peers", required=True, help="the folder holding torch_gpt.py")
p.add_argument("--layers", type=int, default=8)
p.add_argument("--width", type=int, default=512)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--context", type=int, default=128)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
p.add_argument("--tf32", action="store_true")
a = p.parse_args()

sys.path.insert(0, a.peers)
import torch  # noqa: E402
import torch_gpt  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = a.tf32
torch.backends.cudnn.allow_tf32 = a.tf32
torch.manual_seed(0)
dev = torch.device("cuda")
model = torch_gpt.GPT(256, a.context, a.layers, a.width, a.heads).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
g = torch.Generator(device="cpu").manual_seed(1)
times = []
for step in range(a.warmup + a.steps):
    x = torch.randint(0, 128, (a.batch, a.context + 1), generator=g).to(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
print(json.dumps({
    "tokens_per_s": a.batch * a.context / statistics.median(times),
    "median_step_s": statistics.median(times),
    "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
    "dtype": a.dtype, "tf32": a.tf32, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
}))
