"""The price of --check_replicas_every: the main job's step time with the
check off, every step and every 100 steps, side by side in one run.

  python3 tools/replica_check_cost.py bazel-bin/models/train_gpt [--repeats=3]
      [--raw=FILE]

Model: the training-step benchmark's GPT (4 layers, 4 heads, width 256,
context 128, 8 sequences per rank, AdamW), --grad_clip=1 (so K > 0 also
compares the gradient norm every step). Each case trains 112 steps; its step
time is the mean over steps 11..110 (from the job's --metrics_jsonl: the
elapsed time at step k is k x tokens per step / tokens_per_s), which holds
one check at K = 100 (at step 100) and 100 at K = 1, and leaves out the
warm-up and the final evaluation. The cases run interleaved, --repeats
times; the table gives each case's median step time with its range, and
its median ratio to the unchecked case of the same repeat, with the range.
Prints a markdown table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

STEPS, FIRST, LAST = 112, 10, 110
SHAPE = ["--n_layer=4", "--n_head=4", "--n_embd=256", "--block_size=128", "--batch_size=8",
         "--grad_clip=1", "--print_plan=false", "--log_every=1000", "--steps=%d" % STEPS]
CONFIGS = [
    ("no_shard, W = 2 (every rank a replica)", ["--world_size=2", "--sharding_strategy=no_shard"]),
    ("hybrid_shard, W = 4 (2 shards x 2 replicas)",
     ["--world_size=4", "--sharding_strategy=hybrid_shard", "--shard_group_size=2"]),
    ("full_shard, W = 2 (no replicas: buffers only)",
     ["--world_size=2", "--sharding_strategy=full_shard"]),
]
EVERY = [0, 1, 100]


def step_ms(job, flags, raw):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        run = subprocess.run([job] + SHAPE + flags + ["--metrics_jsonl=" + metrics],
                             capture_output=True, text=True, timeout=900)
        raw.write("$ %s\n%s\n" % (" ".join(flags), run.stdout[-400:]))
        if run.returncode != 0:
            sys.exit("failed: %s\n%s%s" % (" ".join(flags), run.stdout[-2000:], run.stderr))
        lines = [json.loads(line) for line in open(metrics)]
    world = int(next(f for f in flags if f.startswith("--world_size=")).split("=")[1])
    tokens = 8 * 128 * world
    by_step = {line["step"]: line["tokens_per_s"] for line in lines}
    elapsed = {k: k * tokens / by_step[k] for k in (FIRST, LAST)}
    return 1000.0 * (elapsed[LAST] - elapsed[FIRST]) / (LAST - FIRST)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw", default=os.devnull)
    args = parser.parse_args()
    times = {}  # (config, every) -> [ms per repeat]
    with open(args.raw, "w") as raw:
        for repeat in range(args.repeats):
            for name, flags in CONFIGS:
                for every in EVERY:
                    ms = step_ms(args.job, flags + ["--check_replicas_every=%d" % every], raw)
                    times.setdefault((name, every), []).append(ms)
                    print("repeat %d, %s, K = %d: %.1f ms" % (repeat + 1, name, every, ms),
                          file=sys.stderr, flush=True)
    print("| case | K | step time, median (range) | vs. unchecked, median (range) |")
    print("| --- | --- | --- | --- |")
    for name, _ in CONFIGS:
        base = times[(name, 0)]
        for every in EVERY:
            t = times[(name, every)]
            ratios = [a / b for a, b in zip(t, base)]
            cell = ("%.3fx (%.3f-%.3f)" % (statistics.median(ratios), min(ratios), max(ratios))
                    if every else "")
            print("| %s | %s | %.1f ms (%.1f-%.1f) | %s |" % (
                name, every or "off", statistics.median(t), min(t), max(t), cell))
    return 0


if __name__ == "__main__":
    sys.exit(main())
