"""PyTorch's side of the GPU training-step benchmark
(models/cuda_step_benchmark.cc): the same GPT (gpt_interop.GPT, nanoGPT's
layout, the C++ GPT's attention), batch and AdamW, trained with PyTorch's
FullyShardedDataParallel ("fsdp:...") and composable fully_shard
("fully_shard:..."), or unwrapped, each block a unit as in the C++ cases.
Every rank runs every case in order; rank 0 appends one JSON line per case
to OUT. Timing and memory are measured as the C++ benchmark does: each
step from its start to a device synchronize after the optimizer step, after
warm-up; the caching allocator's peak allocated and reserved bytes over the
timed steps; the model state (parameters, gradients, AdamW state) the rank
holds on the device.

  python3 fsdp_step_benchmark.py OUT [--device cuda] [--cases a,b,...]
  torchrun --nproc_per_node=W fsdp_step_benchmark.py OUT   # one GPU per rank

Case names: MODEL/IMPL[:VARIANT], MODEL in small, gpt2 (the C++ shapes);
IMPL in unwrapped, fsdp:full_shard, fsdp:shard_grad_op, fsdp:no_shard,
fully_shard:full_shard (reshard_after_forward=True),
fully_shard:shard_grad_op (False); VARIANT bf16 (param_dtype bfloat16,
reduce_dtype float32) or offload (CPU offload of parameters). "--device cpu"
(Gloo) runs where no GPU is, for the unwrapped cases and whatever the
installed torch's FSDP supports on CPU.
"""
import argparse
import gc
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT, Block  # noqa: E402

# As models/cuda_step_benchmark.cc: (n_layer, n_head, n_embd, block, batch per rank).
MODELS = {"small": (4, 4, 256, 128, 8), "gpt2": (12, 12, 768, 1024, 8)}
WARMUP, STEPS = 5, 50
DEFAULT_CASES = [
    "%s/%s" % (model, impl)
    for model in MODELS
    for impl in ("unwrapped", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:no_shard",
                 "fsdp:full_shard:bf16", "fsdp:full_shard:offload",
                 "fully_shard:full_shard", "fully_shard:shard_grad_op",
                 "fully_shard:full_shard:bf16", "fully_shard:full_shard:offload")
]


def wrap_fsdp(model, strategy, variant, device):
    from torch.distributed.fsdp import (CPUOffload, FullyShardedDataParallel, MixedPrecision,
                                        ShardingStrategy)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}),
                  sharding_strategy=getattr(ShardingStrategy, strategy.upper()))
    if device.type == "cuda":
        kwargs["device_id"] = device
    if variant == "bf16":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    elif variant == "offload":
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    return FullyShardedDataParallel(model, **kwargs)


def wrap_fully_shard(model, strategy, variant):
    try:
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                            fully_shard)
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (CPUOffloadPolicy,
                                                        MixedPrecisionPolicy, fully_shard)
    if strategy not in ("full_shard", "shard_grad_op"):
        raise ValueError("fully_shard has no %s" % strategy)
    kwargs = dict(reshard_after_forward=strategy == "full_shard")
    if variant == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    elif variant == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def local_bytes_on(device, t):
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor (fully_shard): this rank's part.
        t = t.to_local()
    return t.numel() * t.element_size() if t.device.type == device.type else 0


def run_case(name, device, rank, world):
    model_name, impl = name.split("/", 1)
    n_layer, n_head, n_embd, block, batch = MODELS[model_name]
    parts = impl.split(":")
    kind, strategy = parts[0], parts[1] if len(parts) > 1 else None
    variant = parts[2] if len(parts) > 2 else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(1)
    model = GPT(dict(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd))
    if not (kind in ("fsdp", "fully_shard") and variant == "offload"):
        model.to(device)
    if kind == "fsdp":
        model = wrap_fsdp(model, strategy, variant, device)
    elif kind == "fully_shard":
        model = wrap_fully_shard(model, strategy, variant)
    elif kind != "unwrapped":
        raise ValueError("unknown case " + name)
    # PyTorch's fused kernel, as the C++ side's FlatShardAdamW
    # (models/cuda_step_benchmark.cc), for GPU parameters and, from torch 2.4
    # (which has the CPU kernel), for offloaded host ones too.
    on_gpu = all(p.device.type == "cuda" for p in model.parameters())
    has_cpu_kernel = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                  **({"fused": True} if on_gpu or has_cpu_kernel else {}))
    torch.manual_seed(100 + rank)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        tokens = torch.randint(256, (batch, block + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # 1.13 defaults to zeroing, 2.x to None.

    for _ in range(WARMUP):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    state_bytes = 0
    for p in model.parameters():
        state_bytes += local_bytes_on(device, p) + local_bytes_on(device, p.grad)
    for s in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state_bytes += local_bytes_on(device, s.get(key))
    ordered = sorted(times)
    median = ordered[len(times) // 2]
    result = dict(name="BM_PyTorchStep/%s/%s/W:%d" % (model_name, impl, world),
                  torch=torch.__version__, mean_ms=sum(times) / len(times), median_ms=median,
                  p10_ms=ordered[len(times) // 10], p90_ms=ordered[len(times) * 9 // 10],
                  tokens_per_s=batch * block * world / (median / 1e3),
                  model_state_MiB=state_bytes / 1048576.0)
    if device.type == "cuda":
        result["peak_allocated_MiB"] = torch.cuda.max_memory_allocated(device) / 1048576.0
        result["peak_reserved_MiB"] = torch.cuda.max_memory_reserved(device) / 1048576.0
    del model, optimizer
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    args = parser.parse_args()
    if "RANK" not in os.environ:  # Alone: a group of one.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # As the C++ side: untimed steps first, so that the first use of the
    # device and its libraries is not charged to the first case.
    run_case("small/unwrapped", device, rank, world)
    failed = 0
    for name in args.cases.split(","):
        try:
            result = run_case(name, device, rank, world)
        except Exception as e:  # Reported, and the next case runs.
            result = dict(name="BM_PyTorchStep/%s/W:%d" % (name, world),
                          error="%s: %s" % (type(e).__name__, e))
            failed += 1
        if rank == 0:
            print(json.dumps(result), flush=True)
            with open(args.out, "a") as out:
                out.write(json.dumps(result) + "\n")
        dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
