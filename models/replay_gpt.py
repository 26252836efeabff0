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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
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
    print("largest loss difference %.3g" % worst)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["init", "init_dcp", "replay"])
    parser.add_argument("paths", nargs="+")
    for name, default in [("block_size", 32), ("n_layer", 2), ("n_head", 4), ("n_embd", 64),
                          ("seed", 5)]:
        parser.add_argument("--" + name, type=int, default=default)
    for name, default in [("lr", 3e-3), ("beta1", 0.9), ("beta2", 0.99), ("eps", 1e-8),
                          ("weight_decay", 0.01), ("grad_clip", 1.0), ("tolerance", 1e-4)]:
        parser.add_argument("--" + name, type=float, default=default)
    args = parser.parse_args()
    sys.exit({"init": init, "init_dcp": init_dcp, "replay": replay}[args.mode](args) or 0)
