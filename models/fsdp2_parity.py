"""Python side of //models:fsdp2_parity_test: PyTorch's own FSDP2
(fully_shard) trains the GPT of gpt_interop.py (nanoGPT's layout) from the
test's initial weights on the test's batches, one fully_shard group per
block and one for the root, as our FSDP wraps the C++ GPT. One rank,
launched by the test through this project's launcher (torchrun's
environment, env:// rendezvous, Gloo). Rank 0 writes DIR/py_losses.pt (the
global mean loss of each step) and DIR/py_final.pt (the full parameters
after the last step).

  python3 fsdp2_parity.py DIR STRATEGY PRECISION SHARD_GROUP_SIZE \
      n_layer n_head n_embd block_size lr weight_decay [RESHARD_AFTER_FORWARD]

STRATEGY: full_shard, shard_grad_op (reshard_after_forward=False) or
hybrid_shard (a 2-D mesh: replicate x SHARD_GROUP_SIZE); PRECISION: fp32, or
bf16 (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)).
RESHARD_AFTER_FORWARD, an int k > 0, replaces full_shard's True (reshard to
groups of k ranks after forward).
DIR holds init.pt (the initial state dict) and batches.pt ("tokens":
[steps, global batch, block_size + 1]).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT  # noqa: E402


def main():
    if len(sys.argv) not in (11, 12):
        sys.exit(__doc__)
    directory, strategy, precision = sys.argv[1:4]
    shard_group_size, n_layer, n_head, n_embd, block_size = map(int, sys.argv[4:9])
    lr, weight_decay = map(float, sys.argv[9:11])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(dict(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd))
    model.load_state_dict(torch.load(directory + "/init.pt", weights_only=True), strict=True)
    if strategy == "hybrid_shard":
        mesh = init_device_mesh("cpu", (world // shard_group_size, shard_group_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs = dict(mesh=mesh, reshard_after_forward=strategy != "shard_grad_op")
    if len(sys.argv) == 12 and int(sys.argv[11]) > 0:
        k = int(sys.argv[11])
        # FSDP2 reads 1 as False (keep everything); only full_shard takes k.
        if strategy != "full_shard" or not 1 < k < world:
            sys.exit(f"RESHARD_AFTER_FORWARD={k} needs full_shard and 1 < k < {world}")
        kwargs["reshard_after_forward"] = k
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=weight_decay, foreach=False)
    tokens = torch.load(directory + "/batches.pt", weights_only=True)["tokens"]
    rows = tokens.size(1) // world
    losses = []
    for step in range(tokens.size(0)):
        batch = tokens[step, rank * rows:(rank + 1) * rows]
        logits = model(batch[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        torch.save({"losses": torch.tensor(losses, dtype=torch.float64)},
                   directory + "/py_losses.pt")
        torch.save({k: v.float() for k, v in full.items()}, directory + "/py_final.pt")
    dist.barrier()
    dist.destroy_process_group()
    # With torch 2.15, one rank in a few aborts at interpreter exit after its
    # Gloo group was destroyed ("terminate called without an active
    # exception", seen at W = 3); its work is done and its files are closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
