"""PyTorch beside `zerodp train --model-config` and `zerodp bench train --model-config`: the
transformers model a config.json describes (GPT2LMHeadModel, LlamaForCausalLM, ...; random init),
DDP over gloo, AdamW, one micro-batch of `--batch` x `--context` tokens per rank,
bf16 autocast (or fp32). Prints one JSON line (rank 0): tokens/s over the timed steps (global
tokens / median step wall time) and the peak resident set of rank 0's process.

  torchrun --nproc_per_node 2 --master_addr 127.0.0.1 scripts/gpt2_peer_bench.py --config config.json
"""
import argparse, json, os, resource, statistics, time

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--context", type=int, default=1024)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--warmup", type=int, default=1)
p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--ddp", action="store_true",
               help="wrap in DDP even at world size 1 (under torchrun): a DDP rank's memory, buckets included")
a = p.parse_args()

torch.set_num_threads(a.threads)
world = int(os.environ.get("WORLD_SIZE", "1"))
ddp = world > 1 or a.ddp
if ddp:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
torch.manual_seed(0)
with open(a.config) as f:
    fields = json.load(f)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
model.config.use_cache = False
if ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
vocab = model.module.config.vocab_size if ddp else model.config.vocab_size
g = torch.Generator().manual_seed(rank)
times = []
for step in range(a.warmup + a.steps):
    x = torch.randint(0, min(vocab, 256), (a.batch, a.context), generator=g)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if ddp:
        dist.barrier()
    if step >= a.warmup:
        times.append(time.perf_counter() - t0)
if rank == 0:
    tokens = a.batch * a.context * world
    print(json.dumps({"tokens_per_s": tokens / statistics.median(times), "median_step_s": statistics.median(times),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "world": world, "ddp": ddp, "dtype": a.dtype, "torch": torch.__version__}))
if ddp:
    dist.destroy_process_group()
