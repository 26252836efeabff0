#!/usr/bin/env python3
"""Tables for models/checkpoint_format_benchmark_results.md.

Reads the JSON of several runs of //models:checkpoint_format_benchmark
(--benchmark_format=json, one file per run) and prints, per world size, each
format's median save and load time over the runs (each run's figure is the
median of its 30 calls), the DCP / SHARDED ratio's median and range over the
runs, and the bytes and files on disk.

    tools/checkpoint_format_benchmark_table.py run1.json run2.json run3.json
"""
import json
import statistics
import sys


def main(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append({b["name"]: b for b in json.load(f)["benchmarks"]})
    def world_of(name):
        return int(name.split("W:")[1].split("/")[0])

    names = sorted(runs[0], key=world_of)
    print("| W | op | SHARDED ms | DCP ms | DCP / SHARDED, median (range) |")
    print("|---|---|---|---|---|")
    for name in names:
        world = world_of(name)
        for op in ("save", "load"):
            sharded = [r[name][f"sharded_{op}_ms"] for r in runs]
            dcp = [r[name][f"dcp_{op}_ms"] for r in runs]
            ratios = [d / s for d, s in zip(dcp, sharded)]
            print(f"| {world} | {op} | {statistics.median(sharded):.1f} | "
                  f"{statistics.median(dcp):.1f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    print()
    print("| W | SHARDED MiB | SHARDED files | DCP MiB | DCP files |")
    print("|---|---|---|---|---|")
    for name in names:
        world = world_of(name)
        r = runs[0][name]
        print(f"| {world} | {r['sharded_MiB']:.2f} | {int(r['sharded_files'])} | "
              f"{r['dcp_MiB']:.2f} | {int(r['dcp_files'])} |")


if __name__ == "__main__":
    main(sys.argv[1:])
