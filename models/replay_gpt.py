"""Replays a train_gpt run in PyTorch: the GPT of nanoGPT's layout
(gpt_interop.GPT), the same initial state dict, the batches the run recorded
with --record_batches, AdamW and global-norm clipping as train_gpt applies
them; prints each step's loss and fails if it differs from the run's
--metrics_jsonl. Used by train_gpt_test; usable by hand:

  /usr/bin/python3 models/replay_gpt.py init OUT.pt --n_layer=2 ...
  models/replay_gpt.py init_dcp OUT_DIR ...   (the same, as a DCP checkpoint
                                               {"model": state dict}; exits 3
                                               without torch.distributed.checkpoint)
  /usr/bin/python3 models/replay_gpt.py replay INIT.pt BATCHES.pt METRICS.jsonl ...

replay's --save_after=N --save_prefix=P writes, after step N, P_model.pt and
P_optim.pt (model.state_dict() and the optimizer's state_dict()),
P_batches.pt (the batches of the later steps, as --record_batches writes
them) and, with torch 2.x, P_dcp (both as a Distributed Checkpoint);
--check_optim=PATH compares an optimizer state train_gpt exported
(--export_optim_state_dict_keys=index) with the replay's at the end, and
loads it into a torch.optim.AdamW; --check_dcp=DIR loads train_gpt's
--export_dcp as an FSDP2 job does and compares it likewise.
--weight_decay_groups=nanogpt groups the parameters as nanoGPT does (and
train_gpt's flag of that name).
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_interop import GPT  # noqa: E402


def config_of(args):
    return dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer,
                n_head=args.n_head, n_embd=args.n_embd)


def init(args):
    """A PyTorch-initialized model's state dict: where both runs start."""
    torch.manual_seed(args.seed)
    model = GPT(config_of(args))
    torch.save(model.state_dict(), args.paths[0])


def init_dcp(args):
    """init's state dict as PyTorch's Distributed Checkpoint, under "model"
    as an FSDP2 job saves {"model": ..., "optim": ...}."""
    try:
        import torch.distributed.checkpoint as dcp
        dcp.save  # noqa: B018
    except (ImportError, AttributeError):
        print("torch %s cannot write DCP checkpoints" % torch.__version__)
        return 3
    torch.manual_seed(args.seed)
    model = GPT(config_of(args))
    dcp.save({"model": model.state_dict()}, checkpoint_id=args.paths[0], no_dist=True)


def replay(args):
    init_path, batches_path, metrics_path = args.paths
    model = GPT(config_of(args))
    model.load_state_dict(torch.load(init_path, weights_only=True), strict=True)
    recorded = torch.load(batches_path, weights_only=True)
    tokens = recorded["tokens"]
    expected = [json.loads(line)["loss"] for line in open(metrics_path)]
    if len(expected) != tokens.size(0):
        print("replay: %d recorded batches but %d metric lines" % (tokens.size(0), len(expected)))
        return 1
    if args.weight_decay_groups == "nanogpt":
        # nanoGPT's configure_optimizers: matrices and embeddings decay,
        # biases and LayerNorm do not.
        named = dict(model.named_parameters())
        groups = [{"params": [p for p in named.values() if p.dim() >= 2],
                   "weight_decay": args.weight_decay},
                  {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0}]
    else:
        groups = model.parameters()
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2),
                                  eps=args.eps, weight_decay=args.weight_decay)
    worst = 0.0
    for step in range(tokens.size(0)):
        batch = tokens[step]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)  # 1.13 defaults to zeroing, 2.x to None.
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        worst = max(worst, abs(loss.item() - expected[step]))
        print("step %d: PyTorch loss %.6f, train_gpt loss %.6f" % (step + 1, loss.item(),
                                                                   expected[step]))
        if step + 1 == args.save_after:
            torch.save(model.state_dict(), args.save_prefix + "_model.pt")
            torch.save(optimizer.state_dict(), args.save_prefix + "_optim.pt")
            torch.save({"tokens": tokens[step + 1:].clone(), "first_step": torch.tensor(1)},
                       args.save_prefix + "_batches.pt")
            save_dcp(model, optimizer, args.save_prefix + "_dcp")
    print("largest loss difference %.3g" % worst)
    if args.check_optim and not check_optim(args.check_optim, model, optimizer):
        return 1
    if args.check_dcp and not check_dcp(args.check_dcp, model, optimizer):
        return 1
    return 0 if worst <= args.tolerance else 1


def save_dcp(model, optimizer, directory):
    """Model and optimizer as a Distributed Checkpoint laid out as an FSDP2
    job saves them ({"model": ..., "optim": get_optimizer_state_dict}), where
    this torch can (2.x)."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    except ImportError:
        return
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process": it is.
        dcp.save({"model": model.state_dict(),
                  "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=directory, no_dist=True)


def check_dcp(directory, model, optimizer):
    """Whether train_gpt's --export_dcp loads, as an FSDP2 job loads its
    checkpoints, into the replay's model and optimizer state."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                             set_optimizer_state_dict)
    except ImportError:
        print("check_dcp: this torch cannot read Distributed Checkpoints")
        return True
    import copy
    import warnings
    fresh_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.zero_()  # What dcp.load must overwrite.
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming ... a single process": it is.
        state = {"model": fresh_model.state_dict(),
                 "optim": get_optimizer_state_dict(fresh_model, fresh)}
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    fresh_model.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh_model, fresh, state["optim"])
    # Parameters absolutely: AdamW moves a near-zero one by a part of lr
    # either way on gradients that differ in the last bits (the job ran at
    # W = 2); a checkpoint not loaded leaves them 0.
    param_gap = max((p - q).abs().max().item()
                    for p, q in zip(model.parameters(), fresh_model.parameters()))
    worst = 0.0
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            mine, loaded = optimizer.state[p][key], fresh.state[q][key]
            worst = max(worst, (mine - loaded).abs().max().item() /
                        max(mine.abs().max().item(), 1e-12))
    steps = {float(fresh.state[q]["step"]) for q in fresh_model.parameters()}
    ok = steps == {float(optimizer.state[p]["step"]) for p in model.parameters()}
    ok = ok and fresh.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    print("check_dcp: steps and lr %s; parameters within %.3g, optimizer state within %.3g "
          "of its scale" % ("equal" if ok else "DIFFER", param_gap, worst))
    return ok and param_gap <= 1e-3 and worst <= 1e-3


def check_optim(path, model, optimizer):
    """Whether train_gpt's exported optimizer state is the replay's, up to
    the runs' float differences, and what torch.optim.AdamW loads."""
    # torch 1.13's weights_only reader lacks BINFLOAT, which every float of
    # a pickle uses: it refuses its own optimizers' state dicts too.
    ours = torch.load(path, weights_only=int(torch.__version__.split(".")[0]) >= 2)
    mine = optimizer.state_dict()
    ok = sorted(ours["state"]) == sorted(mine["state"])
    ok = ok and [g["params"] for g in ours["param_groups"]] == [
        g["params"] for g in mine["param_groups"]]
    worst = 0.0
    for index, state in mine["state"].items():
        if sorted(ours["state"].get(index, {})) != sorted(state):
            print("check_optim: state %s has keys %s in the export, %s here"
                  % (index, sorted(ours["state"].get(index, {})), sorted(state)))
            return False
        for key, value in state.items():
            theirs = ours["state"].get(index, {}).get(key)
            if key == "step":
                ok = ok and theirs is not None and float(theirs) == float(value)
                continue
            if theirs is None or theirs.shape != value.shape:
                print("check_optim: state %s %s missing or of another shape" % (index, key))
                return False
            scale = value.abs().max().item()
            worst = max(worst, (theirs - value).abs().max().item() / max(scale, 1e-12))
    for key in ("lr", "betas", "eps", "weight_decay"):
        exported, replayed = ours["param_groups"][0][key], mine["param_groups"][0][key]
        if key == "betas":
            exported, replayed = tuple(exported), tuple(replayed)
        if exported != replayed:
            print("check_optim: %s is %s in the export, %s here" % (key, exported, replayed))
            ok = False
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    fresh.load_state_dict(ours)
    ok = ok and fresh.param_groups[0]["lr"] == mine["param_groups"][0]["lr"]
    print("check_optim: keys, steps and options %s; largest state difference %.3g of its scale"
          % ("equal" if ok else "DIFFER", worst))
    return ok and worst <= 1e-3


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["init", "init_dcp", "replay"])
    parser.add_argument("paths", nargs="+")
    for name, default in [("block_size", 32), ("n_layer", 2), ("n_head", 4), ("n_embd", 64),
                          ("seed", 5), ("save_after", 0)]:
        parser.add_argument("--" + name, type=int, default=default)
    for name, default in [("lr", 3e-3), ("beta1", 0.9), ("beta2", 0.99), ("eps", 1e-8),
                          ("weight_decay", 0.01), ("grad_clip", 1.0), ("tolerance", 1e-4)]:
        parser.add_argument("--" + name, type=float, default=default)
    parser.add_argument("--weight_decay_groups", choices=["one", "nanogpt"], default="one")
    parser.add_argument("--save_prefix", default="")
    parser.add_argument("--check_optim", default="")
    parser.add_argument("--check_dcp", default="")
    args = parser.parse_args()
    sys.exit({"init": init, "init_dcp": init_dcp, "replay": replay}[args.mode](args) or 0)
