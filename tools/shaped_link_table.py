#!/usr/bin/env python3
"""Tables of the shaped-link benchmark (models/train_step_benchmark.cc run
with --shaped_link_rounds=N and --benchmark_out=FILE.json; one or more
such files): for each model and link rate, each case's step time (median
over rounds), the bytes that crossed the link per step (median) and peak
RSS (the largest over rounds), with ours divided by PyTorch's of the same
kind. A ratio is taken within each round of one file (the cases of a round
ran one after another) and the table shows the median over those rounds,
their range and how many there were (n); a ratio marked * divides medians
from different files instead (no round of one file had both cases).

  tools/shaped_link_table.py RUN.json [RUN.json ...]
"""
import json
import statistics
import sys
from collections import defaultdict

# Ours, and the PyTorch case each is set against.
CASES = [
    ("pytorch_fsdp2", "PyTorch FSDP2 (fully_shard)", None),
    ("full_shard", "FULL_SHARD", "pytorch_fsdp2"),
    ("full_shard:int8", "FULL_SHARD, int8 all-gather + int8 reduction", "pytorch_fsdp2"),
    ("full_shard:hier", "FULL_SHARD, two-level collectives", "pytorch_fsdp2"),
    ("full_shard:hier:int8", "FULL_SHARD, two-level, int8 all-gather + int8 reduction",
     "pytorch_fsdp2"),
    ("pytorch_fsdp2_hpz", "PyTorch FSDP2, reshard_after_forward=2", None),
    ("full_shard:hpz", "FULL_SHARD, post_forward group = host (hpZ)", "pytorch_fsdp2_hpz"),
    ("pytorch_fsdp2_zero2", "PyTorch FSDP2, reshard_after_forward=False", None),
    ("shard_grad_op", "SHARD_GRAD_OP", "pytorch_fsdp2_zero2"),
    ("pytorch_hsdp", "PyTorch HSDP (fully_shard, 2 x 2 mesh)", None),
    ("hybrid_shard", "HYBRID_SHARD (shard within host)", "pytorch_hsdp"),
    ("hybrid_shard:int8", "HYBRID_SHARD, int8 all-gather + int8 reduction (across hosts too)",
     "pytorch_hsdp"),
    ("hybrid_shard:int8_reduce", "HYBRID_SHARD, int8 reduction only", "pytorch_hsdp"),
    ("pytorch_ddp", "PyTorch DDP", None),
    ("no_shard", "NO_SHARD", "pytorch_ddp"),
]
MODELS = {"gpt": "benchmark GPT (4 x 256, 3.3 M parameters, 8 x 128 tokens per rank)",
          "gpt_wide": "wide GPT (4 x 512, 12.7 M parameters, 1 x 32 tokens per rank)"}


def load(paths):
    """{(model, rate, mode): {(file, round): run}} and the errors."""
    runs = defaultdict(dict)
    errors = []
    for index, path in enumerate(paths):
        with open(path) as f:
            data = json.load(f)
        for b in data["benchmarks"]:
            parts = b["name"].split("/")
            if parts[0] != "BM_ShapedLink":
                continue
            model, rate, mode, rnd = parts[1], parts[2], parts[3], int(parts[4].split(":")[1])
            if b.get("error_occurred"):
                errors.append("%s (%s): %s" % (b["name"], path, b.get("error_message", "")))
                continue
            runs[(model, rate, mode)][(index, rnd)] = b
    return runs, errors


def ratio(mine, ref, key):
    """Median (range, n) of mine / ref over the rounds both ran, or of the
    medians (marked *) when no round ran both."""
    paired = [mine[r][key] / ref[r][key] for r in mine if r in ref and ref[r][key] > 0]
    if paired:
        med = statistics.median(paired)
        if len(paired) == 1:
            return "%.2fx (n=1)" % med
        return "%.2fx (%.2f-%.2f, n=%d)" % (med, min(paired), max(paired), len(paired))
    if mine and ref:
        return "%.2fx*" % (statistics.median(b[key] for b in mine.values()) /
                           statistics.median(b[key] for b in ref.values()))
    return "-"


def main():
    runs, errors = load(sys.argv[1:])
    rates = sorted({k[1] for k in runs}, key=lambda r: int(r.replace("Gbit", "")))
    for rate in rates:
        for model in MODELS:
            if not any(k[0] == model and k[1] == rate for k in runs):
                continue
            print("### %s, %s link\n" % (MODELS[model], rate.replace("Gbit", " Gbit/s")))
            print("| case | step (ms) | / PyTorch's | / DDP's | link MiB per step | "
                  "/ FSDP2's link bytes | peak RSS (MiB) |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for mode, label, theirs in CASES:
                mine = runs.get((model, rate, mode), {})
                if not mine:
                    continue
                ref = lambda other: runs.get((model, rate, other), {})  # noqa: E731
                print("| %s | %.0f | %s | %s | %.1f | %s | %.0f |" % (
                    label,
                    statistics.median(b["real_time"] for b in mine.values()),
                    ratio(mine, ref(theirs), "real_time") if theirs else "",
                    ratio(mine, ref("pytorch_ddp"), "real_time") if mode != "pytorch_ddp" else "",
                    statistics.median(b["link_MiB_per_step"] for b in mine.values()),
                    ratio(mine, ref("pytorch_fsdp2"), "link_MiB_per_step")
                    if mode != "pytorch_fsdp2" else "",
                    max(b["peak_rss_MiB"] for b in mine.values())))
            print()
    if errors:
        print("Cases that did not run:\n")
        for e in errors:
            print("- " + e.replace("\n", " "))


if __name__ == "__main__":
    main()
