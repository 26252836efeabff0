"""PyTorch's side of //fsdp:host_overhead_benchmark: FSDP2 (fully_shard) on
the same structure as the C++ benchmark — N units of one Linear(8, 8) each
under a root without parameters of its own, one row of input, rank 0 of 2
over PyTorch's fake process group, whose collectives return at once without
touching data — against the same model unwrapped. Prints one line:

  forward_us=... backward_us=... base_forward_us=... base_backward_us=...

(medians over the timed steps), or "unavailable=<why>" when this torch has
no FSDP2 or no fake process group.

  python3 host_overhead_fsdp2.py UNITS WARMUP STEPS
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, units):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(units)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def time_passes(model, warmup, steps):
    x = torch.randn(1, 8)
    forward, backward = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        loss = model(x).sum()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if step >= warmup:
            forward.append((middle - start) * 1e6)
            backward.append((end - middle) * 1e6)
    return statistics.median(forward), statistics.median(backward)


def main():
    units, warmup, steps = map(int, sys.argv[1:4])
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        print("unavailable=torch_%s:_%s" % (torch.__version__, str(e).replace(" ", "_")))
        return
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    base_forward, base_backward = time_passes(Net(units), warmup, steps)
    model = Net(units)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    forward, backward = time_passes(model, warmup, steps)
    print("forward_us=%.2f backward_us=%.2f base_forward_us=%.2f base_backward_us=%.2f"
          % (forward, backward, base_forward, base_backward), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
