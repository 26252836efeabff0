#!/usr/bin/env python3
"""Trains the main job's GPT with each --all_gather_quantization and writes
the loss curves side by side, with what each run all-gathered.

  bazel build //models:train_gpt
  python3 models/quantization_curves.py bazel-bin/models/train_gpt OUT_DIR

Writes OUT_DIR/curves.csv (model, seed, step, loss per option) and
OUT_DIR/summary.md (final losses, their ratio to float32's, all-gathered
bytes by the job's own counters, median tokens/s). Runs of one seed share
initialization and data, so they differ only in how the parameters travel;
three seeds show how far float32 runs alone land apart.
"""
import json
import os
import re
import statistics
import subprocess
import sys

OPTIONS = ["none", "bf16", "int8"]
MODELS = {
    # The main job's default GPT: 2 blocks of width 64.
    "gpt-default": [],
    # Wider blocks, whose all-gathers are most of the bytes a step moves.
    "gpt-4x256": ["--n_layer=4", "--n_embd=256"],
}
STEPS = 400
WORLD = 2
SEEDS = [1, 2, 3]
TAIL = 50  # Final loss: the mean of the last TAIL steps.


def run(binary, model_flags, option, seed, out_dir, name):
    metrics = os.path.join(out_dir, f"{name}-seed{seed}-{option}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # The job appends.
    command = [binary, f"--world_size={WORLD}", f"--steps={STEPS}", f"--seed={seed}",
               f"--all_gather_quantization={option}", f"--metrics_jsonl={metrics}"] + model_flags
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    gathered = re.search(r"rank 0: .*all-gathered ([0-9.]+) MiB in (\d+) calls", output)
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    return {
        "losses": [r["loss"] for r in rows],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[10:]),
        "gathered_mib": float(gathered.group(1)),
        "calls": int(gathered.group(2)),
    }


def main():
    binary, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for name, flags in MODELS.items():
        for seed in SEEDS:
            for option in OPTIONS:  # Interleaved, so that drift in the machine hits all alike.
                r = run(binary, flags, option, seed, out_dir, name)
                results[(name, seed, option)] = r
                print(name, seed, option, r["losses"][-1], flush=True)
    with open(os.path.join(out_dir, "curves.csv"), "w") as f:
        f.write("model,seed,step," + ",".join(f"loss_{o}" for o in OPTIONS) + "\n")
        for name in MODELS:
            for seed in SEEDS:
                for step in range(STEPS):
                    losses = [f"{results[(name, seed, o)]['losses'][step]:.6f}" for o in OPTIONS]
                    f.write(f"{name},{seed},{step + 1}," + ",".join(losses) + "\n")

    def final(name, seed, option):
        return statistics.mean(results[(name, seed, option)]["losses"][-TAIL:])

    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(f"| model | all-gather | final loss, seeds {SEEDS} (mean of the last {TAIL} "
                f"steps) | mean over seeds | vs float32 | all-gathered per rank | vs float32 "
                f"| tokens/s (median) |\n")
        f.write("| --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for name in MODELS:
            base = statistics.mean(final(name, s, "none") for s in SEEDS)
            base_bytes = results[(name, SEEDS[0], "none")]["gathered_mib"]
            for option in OPTIONS:
                finals = [final(name, s, option) for s in SEEDS]
                mean = statistics.mean(finals)
                r = results[(name, SEEDS[0], option)]
                speed = statistics.median(results[(name, s, option)]["tokens_per_s"] for s in SEEDS)
                f.write(f"| {name} | {option} | {', '.join(f'{x:.4f}' for x in finals)} | "
                        f"{mean:.4f} | {mean / base - 1:+.2%} | {r['gathered_mib']:.1f} MiB | "
                        f"{r['gathered_mib'] / base_bytes:.3f}x | {speed:.0f} |\n")


if __name__ == "__main__":
    main()
