"""PyTorch's side of //models:optimizer_step_benchmark: the optimizer step of
torch.optim.AdamW and SGD (momentum) over the parameters of the same GPT
(gpt_interop.GPT), each parameter its own tensor as PyTorch keeps them, in
one implementation per run (the benchmark runs each in a process of its
own): the per-parameter loop, foreach (one multi-tensor op per stage) or
fused (one kernel; torch >= 2.4 on the CPU). Gradients are random
and stay set, so every timed step does the full work. Prints

  median_ms=<m> p10_ms=<a> p90_ms=<b>
  unavailable=<why>

  python3 pytorch_optimizer_benchmark.py VARIANT n_layer n_head n_embd block warmup steps

VARIANT: adamw_ or sgd_ followed by for_loop, foreach or fused.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT  # noqa: E402

def make(variant, params):
    kind, impl = variant.split("_", 1)
    flags = {"for_loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True)}[impl]
    if kind == "adamw":
        # The C++ side's options: lr 1e-3, weight decay 0.01, libtorch's betas.
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags)


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main():
    variant = sys.argv[1]
    n_layer, n_head, n_embd, block, warmup, steps = map(int, sys.argv[2:8])
    torch.manual_seed(0)
    model = GPT(dict(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    try:
        optimizer = make(variant, params)
        with torch.no_grad():
            for _ in range(warmup):
                optimizer.step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                optimizer.step()
                times.append((time.perf_counter() - start) * 1e3)
    except (RuntimeError, TypeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        print("unavailable=" + reason.replace(" ", "_"), flush=True)
        return
    times.sort()
    print(f"median_ms={percentile(times, 0.5):.4f} p10_ms={percentile(times, 0.1):.4f} "
          f"p90_ms={percentile(times, 0.9):.4f}", flush=True)


if __name__ == "__main__":
    main()
