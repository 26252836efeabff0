"""PyTorch's side of //optim:torch_optim_file_test.

    optim_interop.py KEYING DIR
    optim_interop.py dcp_fsdp2 DIR       (each rank, started by our launcher)
    optim_interop.py load_dcp_fsdp2 DIR  (likewise)

DIR holds what the C++ test wrote after 3 steps of fsdp::testing::Net with
AdamW: model.pt (the model's state dict), optim.pt (the optimizer's, keyed
as KEYING says) and data.pt (inputs x<step> and targets y<step>). This
script builds the same model in PyTorch, loads both, and:
  - index: into a plain model and torch.optim.AdamW (Optimizer.load_state_dict);
  - fqn: into a model under FSDP2 (fully_shard, one Gloo rank) through
    torch.distributed.checkpoint.state_dict.set_optimizer_state_dict with
    full_state_dict=True.
Both optimizers are built with a learning rate and weight decay the loaded
groups must replace. It trains steps 3-5, writes its model and optimizer
state (model_py.pt, optim_py.pt; the fqn case through
get_optimizer_state_dict), trains steps 6-8, and writes the losses and the
final parameters to result.pt. Exit 3: this torch has no FSDP2.

dcp_fsdp2: one of two FSDP2 ranks (Gloo) from model.pt's weights, each on
its half of every global batch: trains steps 0-2, saves model and
optimizer as a Distributed Checkpoint ({"model": ..., "optim": ...} from
get_state_dict, the layout of PyTorch's FSDP2 recipes) in DIR/ckpt, trains
steps 3-5; rank 0 writes the global losses of steps 3-5 to result.pt.
"""
import os
import sys

import torch


class Block(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(torch.nn.Module):
    """fsdp::testing::Net (fsdp/test_models.h)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(7, 13), Block(13, 11), Block(11, 9)])
        self.head = torch.nn.Linear(9, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dcp_fsdp2(directory):
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return 3
    path = lambda name: os.path.join(directory, name)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(path("data.pt"))
    model = Net()
    model.load_state_dict(torch.load(path("model.pt")))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for step in range(6):
        if step == 3:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path("ckpt"))
        x, y = data["x%d" % step], data["y%d" % step]
        rows = x.size(0) // world
        loss = torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]),
                                            y[rank * rows:(rank + 1) * rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        torch.save({"losses": torch.tensor(losses[3:], dtype=torch.float32)}, path("result.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def load_dcp_fsdp2(directory):
    """One of two FSDP2 ranks: restores model and optimizer from the
    Distributed Checkpoint in DIR/ours (written by the C++ test after step
    2) as an FSDP2 job does, trains steps 3-5; rank 0 writes their global
    losses to result_load.pt."""
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return 3
    path = lambda name: os.path.join(directory, name)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(path("data.pt"))
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path("ours"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    assert optimizer.param_groups[0]["lr"] == 0.01, optimizer.param_groups[0]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1, optimizer.param_groups[0]
    losses = []
    for step in range(3, 6):
        x, y = data["x%d" % step], data["y%d" % step]
        rows = x.size(0) // world
        loss = torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]),
                                            y[rank * rows:(rank + 1) * rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        torch.save({"losses": torch.tensor(losses, dtype=torch.float32)},
                   path("result_load.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main():
    if sys.argv[1] == "dcp_fsdp2":
        return dcp_fsdp2(sys.argv[2])
    if sys.argv[1] == "load_dcp_fsdp2":
        return load_dcp_fsdp2(sys.argv[2])
    keying, directory = sys.argv[1], sys.argv[2]
    path = lambda name: os.path.join(directory, name)
    data = torch.load(path("data.pt"))
    model = Net()
    model.load_state_dict(torch.load(path("model.pt")))
    if keying == "fqn":
        try:
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                set_optimizer_state_dict)
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            return 3
        dist.init_process_group("gloo", init_method="file://" + path("rendezvous"), rank=0,
                                world_size=1)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    full = None
    if keying == "fqn":
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        set_optimizer_state_dict(model, optimizer, torch.load(path("optim.pt")), options=full)
    else:
        optimizer.load_state_dict(torch.load(path("optim.pt")))
    assert optimizer.param_groups[0]["lr"] == 0.01, optimizer.param_groups[0]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1, optimizer.param_groups[0]

    losses = []

    def train(steps):
        for step in steps:
            loss = torch.nn.functional.mse_loss(model(data["x%d" % step]), data["y%d" % step])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())

    train(range(3, 6))
    if keying == "fqn":
        torch.save(get_model_state_dict(model, options=full), path("model_py.pt"))
        torch.save(get_optimizer_state_dict(model, optimizer, options=full), path("optim_py.pt"))
    else:
        torch.save(model.state_dict(), path("model_py.pt"))
        torch.save(optimizer.state_dict(), path("optim_py.pt"))
    train(range(6, 9))
    final = get_model_state_dict(model, options=full) if keying == "fqn" else model.state_dict()
    result = {k: v.detach().clone() for k, v in final.items()}
    result["losses"] = torch.tensor(losses, dtype=torch.float32)
    torch.save(result, path("result.pt"))
    if keying == "fqn":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
