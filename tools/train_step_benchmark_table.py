#!/usr/bin/env python3
"""Turns the console output of //models:train_step_benchmark into the tables
of models/train_step_benchmark_results.md.

    tools/train_step_benchmark_table.py < raw.txt > tables.md
"""
import re
import sys

LINE = re.compile(r"(BM_\w+)/(\w+)/W:(\d+)/iterations:1/manual_time\s+([\d.]+) ms.*?"
                  r"model_state_MiB=([\d.]+)\S* peak_rss_MiB=([\d.]+)\S*"
                  r"(?: sent_MiB_per_step=([\d.]+)(k?))?")
TORCH = re.compile(r"pytorch side: .*\(torch (\S+)\)")
OURS = [("single", "plain libtorch, one process, whole global batch"),
        ("full_shard", "FSDP FULL_SHARD"),
        ("shard_grad_op", "FSDP SHARD_GRAD_OP"),
        ("no_shard", "FSDP NO_SHARD (DDP-equivalent)")]
THEIRS = [("pytorch_fsdp2", "PyTorch FSDP2 (fully_shard)"),
          ("pytorch_fsdp1", "PyTorch FSDP1 (FULL_SHARD)"),
          ("pytorch_ddp", "PyTorch DDP")]
# Our rows' step time is divided by these (where they ran).
ANCHORS = [("pytorch_fsdp2", "FSDP2"), ("pytorch_ddp", "DDP")]


def table(title, worlds, modes, cell):
    print(title + "\n")
    print("| | " + " | ".join(f"W = {w}" for w in worlds) + " |")
    print("|---|" + "---:|" * len(worlds))
    for mode, label in modes:
        cells = [cell(mode, w) for w in worlds]
        if any(cells):
            print(f"| {label} | " + " | ".join(cells) + " |")
    print()


def main():
    runs = {}
    torch_version = None
    for line in sys.stdin:
        t = TORCH.search(line)
        if t:
            torch_version = t.group(1)
        m = LINE.match(line)
        if m:
            family, mode, world, ms, state, rss, sent, kilo = m.groups()
            sent_mib = float(sent) * (1000 if kilo else 1) if sent else None
            runs[(family, mode, int(world))] = (float(ms), float(state), float(rss), sent_mib)
    theirs = [(mode, f"{label}, torch {torch_version}" if torch_version else label)
              for mode, label in THEIRS]
    modes = OURS + theirs
    worlds = sorted({w for (f, _, w) in runs if f == "BM_TrainStep"})

    def step(mode, w):
        r = runs.get(("BM_TrainStep", mode, w))
        if not r:
            return ""
        ratios = []
        if not mode.startswith("pytorch_"):
            for anchor, name in ANCHORS:
                a = runs.get(("BM_TrainStep", anchor, w))
                if a:
                    ratios.append(f"{r[0] / a[0]:.2f}x {name}")
        return f"{r[0]:.0f}" + (f" ({', '.join(ratios)})" if ratios else "")

    def memory(mode, w):
        r = runs.get(("BM_TrainStep", mode, w))
        return f"{r[1]:.1f} / {r[2]:.0f}" if r else ""

    def sent(mode, w):
        r = runs.get(("BM_TrainStep", mode, w))
        return f"{r[3]:.1f}" if r and r[3] is not None else ""

    table("## Step time (ms, slowest rank; in brackets: / PyTorch's at the same W)",
          worlds, modes, step)
    table("## Memory per rank during the timed steps (MiB): model state held / peak RSS",
          worlds, modes, memory)
    table("## Bytes sent per rank per step (MiB; Gloo's socket writes, slowest rank)",
          worlds, modes, sent)
    families = sorted({f for (f, _, _) in runs if f.startswith("BM_ModelMemory")},
                      key=lambda f: int(re.search(r"(\d+)L", f).group(1)))
    if families:
        mem_worlds = sorted({w for (f, _, w) in runs if f in families})
        print("\n## Memory against model size: blocks of width 512, AdamW\n")
        print("Per rank, MiB: model state held (parameters + gradients + AdamW state) / "
              "peak RSS during the steps.\n")
        print("| model | strategy | " + " | ".join(f"W = {w}" for w in mem_worlds) + " |")
        print("|---|---|" + "---:|" * len(mem_worlds))
        for family in families:
            layers = int(re.search(r"(\d+)L", family).group(1))
            for mode, label in OURS[1:4]:
                cells = []
                for w in mem_worlds:
                    r = runs.get((family, mode, w))
                    cells.append(f"{r[1]:.1f} / {r[2]:.0f}" if r else "")
                if any(cells):
                    print(f"| {layers} blocks | {label} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
