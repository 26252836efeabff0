#!/usr/bin/env python3
"""Turns the console output of //comm:collectives_benchmark into the tables of
comm/collectives_benchmark_results.md (new collective against its naive
fallback, per dtype and world size).

    tools/collectives_benchmark_table.py < raw.txt > tables.md
"""
import collections
import re
import sys

LINE = re.compile(
    r"BM_(\w+)/(\w+)/(\d+)/real_time/threads:(\d+)\s+(\d+) ns.*algbw=(\S+) busbw=(\S+)")
# google-benchmark prints kIs1024 rates with k/M/G meaning KiB/MiB/GiB.
TO_GIB = {"": 1 / 2**30, "k": 1 / 2**20, "M": 1 / 2**10, "G": 1.0}
# Pairs (new, naive) and the dtypes they were run for.
PAIRS = [("AllGather", "AllGatherNaive"), ("ReduceScatter", "ReduceScatterNaive"),
         ("AllReduce", "AllReduceNaive")]


def gib_per_s(text):
    value, unit = re.fullmatch(r"([\d.]+)([kMG]?)/s", text).groups()
    return float(value) * TO_GIB[unit]


def size(num_bytes):
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes} {unit}"
        num_bytes //= 1024
    return f"{num_bytes} GiB"


def duration(ns):
    return f"{ns / 1e3:.0f} us" if ns < 1e7 else f"{ns / 1e6:.1f} ms"


def main():
    runs = collections.defaultdict(dict)  # (dtype, W, bytes) -> op -> (ns, busbw)
    for line in sys.stdin:
        match = LINE.match(line)
        if match:
            op, dtype, num_bytes, world, ns, _, busbw = match.groups()
            runs[(dtype, int(world), int(num_bytes))][op] = (int(ns), gib_per_s(busbw))
    for dtype, dtype_name in (("f32", "float32"), ("bf16", "bfloat16")):
        for world in sorted({w for (d, w, _) in runs if d == dtype}):
            keys = sorted(k for k in runs if k[0] == dtype and k[1] == world)
            pairs = [p for p in PAIRS if all(p[0] in runs[k] and p[1] in runs[k] for k in keys)]
            print(f"\n## {dtype_name}, W = {world}\n")
            header = "| full buffer |"
            rule = "|---:|"
            for new, _ in pairs:
                header += f" {new} | naive | busbw GiB/s new / naive | speed-up |"
                rule += "---:|---:|---:|---:|"
            print(header)
            print(rule)
            for key in keys:
                row = f"| {size(key[2])} |"
                for new, naive in pairs:
                    (t_new, bw_new), (t_old, bw_old) = runs[key][new], runs[key][naive]
                    row += (f" {duration(t_new)} | {duration(t_old)} | {bw_new:.3f} / {bw_old:.3f}"
                            f" | {t_old / t_new:.2f}x |")
                print(row)


if __name__ == "__main__":
    main()
