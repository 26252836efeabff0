"""PyTorch's side of //models:train_step_benchmark: the same GPT
(gpt_interop.GPT, nanoGPT's layout), batch and AdamW trained by PyTorch's
own DistributedDataParallel, FullyShardedDataParallel (FSDP1) or
fully_shard (FSDP2) over Gloo. One rank, launched by the benchmark through
this project's launcher (torchrun's environment, env:// rendezvous). Writes
"step_ms=... peak_rss_mib=... model_state_mib=... sent_mib=..." to
OUT_DIR/rank_<r>.txt, as the C++ workers do, or "unavailable=<why>" when
this torch lacks the wrapper.

  python3 pytorch_step_benchmark.py WRAPPER OUT_DIR n_layer n_head n_embd block batch \
      warmup steps

WRAPPER: ddp, fsdp1 (FULL_SHARD, one unit per block and the root, as ours),
fsdp2 (fully_shard on each block and the root), fsdp2_zero2 (the blocks with
reshard_after_forward=False, as SHARD_GRAD_OP), fsdp2_hpz (the blocks with
reshard_after_forward=LOCAL_WORLD_SIZE: backward all-gathers inside a host)
or hsdp (fully_shard over a 2-D mesh: shard within a host's
LOCAL_WORLD_SIZE ranks, replicate across hosts). Under the shaped-link
cases (FSDP_LINK_TX_BYTES names this host's link counter) the line also has
"link_mib=... host=...": what the host sent over the link per timed step.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT, Block  # noqa: E402


def vm_hwm_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def bytes_written():
    """Bytes this process passed to write(2)-like calls: Gloo's sends
    (writev on its sockets), which the C++ workers count the same way."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def link_bytes_sent():
    """What this host's end of the link has sent so far (the counter file
    the shaped-link benchmark names), or None outside those cases."""
    path = os.environ.get("FSDP_LINK_TX_BYTES")
    if not path:
        return None
    with open(path) as counter:
        return int(counter.read())


def model_state_bytes(wrapped, optimizer):
    """What this rank holds after an optimizer step: its own part of the
    parameters (a DTensor's local shard under FSDP2, the flat shard under
    FSDP1), of their gradients and of the AdamW state."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in wrapped.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for s in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            total += local(s[key]).numel() * s[key].element_size()
    return total


def wrap(wrapper, model):
    """The wrapped model, or a string saying why this torch cannot."""
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        try:
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        except ImportError:
            return "torch %s has no ModuleWrapPolicy" % torch.__version__
        # device_id: on CPU, torch >= 2.7 refuses to guess the device.
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        sharding_strategy=ShardingStrategy.FULL_SHARD,
                                        device_id=torch.device("cpu"))
    if wrapper in ("fsdp2", "fsdp2_zero2", "fsdp2_hpz", "hsdp"):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            return "torch %s has no fully_shard (FSDP2)" % torch.__version__
        kwargs = {}
        if wrapper == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            local = int(os.environ["LOCAL_WORLD_SIZE"])
            kwargs["mesh"] = init_device_mesh("cpu", (dist.get_world_size() // local, local),
                                              mesh_dim_names=("replicate", "shard"))
        block_kwargs = dict(kwargs)
        if wrapper == "fsdp2_zero2":
            block_kwargs["reshard_after_forward"] = False
        elif wrapper == "fsdp2_hpz":
            block_kwargs["reshard_after_forward"] = int(os.environ["LOCAL_WORLD_SIZE"])
        for block in model.transformer.h:
            fully_shard(block, **block_kwargs)
        fully_shard(model, **kwargs)
        return model
    raise ValueError("unknown wrapper " + wrapper)


def main():
    wrapper, out_dir = sys.argv[1:3]
    n_layer, n_head, n_embd, block, batch, warmup, steps = map(int, sys.argv[3:10])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out_path = os.path.join(out_dir, "rank_%d.txt" % rank)
    torch.manual_seed(1)
    model = GPT(dict(vocab_size=256, block_size=block, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd))
    wrapped = wrap(wrapper, model)
    if isinstance(wrapped, str):
        with open(out_path, "w") as out:
            out.write("unavailable=%s\n" % wrapped.replace(" ", "_"))
        dist.destroy_process_group()
        return
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.01)
    torch.manual_seed(100 + rank)
    times = []
    sent_before = 0
    link_before = None
    for step in range(warmup + steps):
        if step == warmup:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            sent_before = bytes_written()
            link_before = link_bytes_sent()
        tokens = torch.randint(256, (batch, block + 1))
        start = time.perf_counter()
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        if step == warmup + steps - 1:
            state_bytes = model_state_bytes(wrapped, optimizer)
        optimizer.zero_grad(set_to_none=True)  # 1.13 defaults to zeroing, 2.x to None.
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    sent_mib = (bytes_written() - sent_before) / steps / 1048576.0
    link_after = link_bytes_sent()
    times.sort()
    line = ("step_ms=%.3f peak_rss_mib=%.1f model_state_mib=%.2f sent_mib=%.3f"
            % (times[len(times) // 2], vm_hwm_mib(), state_bytes / 1048576.0, sent_mib))
    if link_after is not None:
        line += " link_mib=%.3f host=%s" % ((link_after - link_before) / steps / 1048576.0,
                                            socket.gethostname())
    with open(out_path, "w") as out:
        out.write(line + "\n")
    dist.destroy_process_group()
    # With torch 2.15, one rank in a few aborts at interpreter exit after its
    # Gloo group was destroyed ("terminate called without an active
    # exception", seen at W = 3); its work is done and its files are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
