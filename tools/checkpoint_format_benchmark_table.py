#!/usr/bin/env python3
"""Tables for models/checkpoint_format_benchmark_results.md.

Reads runs of //models:checkpoint_format_benchmark: google-benchmark JSON
files (--benchmark_out=F --benchmark_out_format=json), one per run, or the
committed models/checkpoint_format_benchmark_raw.json, whose sets of runs
--set chooses. Prints, per world size, each format's median save and load
time over the runs (each run's figure is the median of its 30 calls), the
DCP / SHARDED ratio's median and range over the runs, and the bytes and
files on disk.

    tools/checkpoint_format_benchmark_table.py run1.json run2.json run3.json
    tools/checkpoint_format_benchmark_table.py models/checkpoint_format_benchmark_raw.json
    tools/checkpoint_format_benchmark_table.py --set before_metadata_cache \\
        models/checkpoint_format_benchmark_raw.json
"""
import argparse
import json
import statistics


def world_of(name):
    return int(name.split("W:")[1].split("/")[0])


def read_runs(paths, which):
    runs = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for run in data[which] if "benchmarks" not in data else [data]:
            runs.append({b["name"]: b for b in run["benchmarks"]})
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", default="runs", help="the raw file's set of runs")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    runs = read_runs(args.paths, args.set)
    names = sorted(runs[0], key=world_of)
    print("| W | op | SHARDED ms | DCP ms | DCP / SHARDED, median (range) |")
    print("|---|---|---|---|---|")
    for name in names:
        for op in ("save", "load"):
            sharded = [r[name][f"sharded_{op}_ms"] for r in runs]
            dcp = [r[name][f"dcp_{op}_ms"] for r in runs]
            ratios = [d / s for d, s in zip(dcp, sharded)]
            print(f"| {world_of(name)} | {op} | {statistics.median(sharded):.1f} | "
                  f"{statistics.median(dcp):.1f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    print()
    print("| W | SHARDED MiB | SHARDED files | DCP MiB | DCP files |")
    print("|---|---|---|---|---|")
    for name in names:
        r = runs[0][name]
        print(f"| {world_of(name)} | {r['sharded_MiB']:.2f} | {int(r['sharded_files'])} | "
              f"{r['dcp_MiB']:.2f} | {int(r['dcp_files'])} |")


if __name__ == "__main__":
    main()
