#!/usr/bin/env python3
"""The table of //models:optimizer_step_benchmark from its JSON output
(--benchmark_out=FILE --benchmark_out_format=json), for
models/optimizer_step_benchmark_results.md: per model and optimizer, each
implementation's step time (the median over repetitions of each run's
median step) with the range of the repetitions' medians, and its ratio to
libtorch's per-parameter optimizer and to PyTorch's foreach one.

  tools/optimizer_step_table.py RESULTS.json
"""
import collections
import json
import statistics
import sys

LABELS = {
    "libtorch": "libtorch, per parameter (torch::optim)",
    "flat_shard": "FlatShard, kExact (ours)",
    "flat_shard_fused": "FlatShard, kFused (ours)",
    "pytorch_for_loop": "PyTorch, for-loop",
    "pytorch_foreach": "PyTorch, foreach",
    "pytorch_fused": "PyTorch, fused",
}


def split(impl):
    """'flat_shard_adamw_fused' -> ('adamw', 'flat_shard_fused')."""
    for kind in ("adamw", "sgd"):
        for prefix in ("libtorch_", "flat_shard_", "pytorch_"):
            if impl.startswith(prefix + kind):
                rest = impl[len(prefix + kind):]
                return kind, prefix.rstrip("_") + rest
    return None, None


def main():
    with open(sys.argv[1]) as f:
        data = json.load(f)
    medians = collections.defaultdict(list)
    errors = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        _, shape, impl = b["run_name"].split("/")[:3]
        if b.get("error_occurred"):
            errors[(shape, impl)] = b.get("error_message", "error")
            continue
        medians[(shape, impl)].append(b["real_time"])
    shapes = sorted({key[0] for key in list(medians) + list(errors)})
    context = data.get("context", {})
    print(f"Host: {context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz; "
          f"{context.get('date', '')}")
    for shape in shapes:
        for kind in ("adamw", "sgd"):
            rows = []
            for (s, impl), values in sorted(medians.items()):
                k, label = split(impl)
                if s == shape and k == kind:
                    rows.append((label, statistics.median(values), min(values), max(values),
                                 len(values)))
            if not rows:
                continue
            by_label = {r[0]: r[1] for r in rows}
            base = by_label.get("libtorch")
            foreach = by_label.get("pytorch_foreach")
            print(f"\n{shape}, {'AdamW' if kind == 'adamw' else 'SGD (momentum)'}:\n")
            print("| implementation | step (ms) | range | runs | vs libtorch | vs PyTorch foreach |")
            print("|---|---|---|---|---|---|")
            order = list(LABELS)
            rows.sort(key=lambda r: order.index(r[0]) if r[0] in order else len(order))
            for label, median, lo, hi, n in rows:
                ratio = f"{median / base:.2f}x" if base else "-"
                vs_foreach = f"{median / foreach:.2f}x" if foreach else "-"
                print(f"| {LABELS.get(label, label)} | {median:.2f} | {lo:.2f}-{hi:.2f} | {n} "
                      f"| {ratio} | {vs_foreach} |")
            for (s, impl), message in sorted(errors.items()):
                k, label = split(impl)
                if s == shape and k == kind:
                    print(f"| {LABELS.get(label, label)} | - | - | 0 | {message} | |")


if __name__ == "__main__":
    main()
