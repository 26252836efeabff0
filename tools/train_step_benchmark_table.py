#!/usr/bin/env python3
"""Turns the console output of //models:train_step_benchmark into the tables
of models/train_step_benchmark_results.md.

    tools/train_step_benchmark_table.py < raw.txt > tables.md
"""
import re
import sys

LINE = re.compile(r"(BM_\w+)/(\w+)/W:(\d+)/iterations:1/manual_time\s+([\d.]+) ms.*?"
                  r"model_state_MiB=([\d.]+)\S* peak_rss_MiB=([\d.]+)")
MODES = [("single", "plain libtorch, one process, whole global batch"),
         ("full_shard", "FSDP FULL_SHARD"),
         ("shard_grad_op", "FSDP SHARD_GRAD_OP"),
         ("no_shard", "FSDP NO_SHARD (DDP-equivalent)"),
         ("pytorch_ddp", "PyTorch DDP (python3-torch 1.13, Gloo)")]


def main():
    runs = {}
    for line in sys.stdin:
        m = LINE.match(line)
        if m:
            family, mode, world, ms, state, rss = m.groups()
            runs[(family, mode, int(world))] = (float(ms), float(state), float(rss))
    worlds = sorted({w for (f, _, w) in runs if f == "BM_TrainStep"})
    print("## Step time (ms, slowest rank; in brackets: / PyTorch DDP at the same W)\n")
    print("| | " + " | ".join(f"W = {w}" for w in worlds) + " |")
    print("|---|" + "---:|" * len(worlds))
    for mode, label in MODES:
        cells = []
        for w in worlds:
            if ("BM_TrainStep", mode, w) not in runs:
                cells.append("")
                continue
            ms = runs[("BM_TrainStep", mode, w)][0]
            ddp = runs.get(("BM_TrainStep", "pytorch_ddp", w))
            ratio = f" ({ms / ddp[0]:.2f}x)" if ddp and mode != "pytorch_ddp" else ""
            cells.append(f"{ms:.0f}{ratio}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\n## Memory per rank during the timed steps (MiB): model state held / peak RSS\n")
    print("| | " + " | ".join(f"W = {w}" for w in worlds) + " |")
    print("|---|" + "---:|" * len(worlds))
    for mode, label in MODES:
        cells = []
        for w in worlds:
            r = runs.get(("BM_TrainStep", mode, w))
            cells.append(f"{r[1]:.1f} / {r[2]:.0f}" if r else "")
        print(f"| {label} | " + " | ".join(cells) + " |")
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
            for mode, label in MODES[1:4]:
                cells = []
                for w in mem_worlds:
                    r = runs.get((family, mode, w))
                    cells.append(f"{r[1]:.1f} / {r[2]:.0f}" if r else "")
                if any(cells):
                    print(f"| {layers} blocks | {label} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
