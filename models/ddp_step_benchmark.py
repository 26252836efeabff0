"""The anchor of //models:train_step_benchmark: PyTorch's own
DistributedDataParallel (Gloo) training the same GPT (gpt_interop.GPT,
nanoGPT's layout) with the same batch and AdamW. One rank, launched by the
benchmark through this project's launcher (torchrun's environment, env://
rendezvous). Writes "step_ms=... peak_rss_mib=... model_state_mib=..." to
OUT_DIR/rank_<r>.txt, as the C++ workers do.

  python3 ddp_step_benchmark.py OUT_DIR n_layer n_head n_embd block batch warmup steps
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT  # noqa: E402


def vm_hwm_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def main():
    out_dir = sys.argv[1]
    n_layer, n_head, n_embd, block, batch, warmup, steps = map(int, sys.argv[2:9])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1)
    model = GPT(dict(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    torch.manual_seed(100 + rank)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        tokens = torch.randint(256, (batch, block + 1))
        start = time.perf_counter()
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # 1.13 defaults to zeroing, 2.x to None.
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    state_bytes = 0
    for p in model.parameters():
        state_bytes += p.numel() * p.element_size()
        if p.grad is not None:
            state_bytes += p.grad.numel() * p.grad.element_size()
    for s in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state_bytes += s[key].numel() * s[key].element_size()
    with open(os.path.join(out_dir, "rank_%d.txt" % rank), "w") as out:
        out.write("step_ms=%.3f peak_rss_mib=%.1f model_state_mib=%.2f\n"
                  % (times[len(times) // 2], vm_hwm_mib(), state_bytes / 1048576.0))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
