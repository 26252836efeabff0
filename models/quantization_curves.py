#!/usr/bin/env python3
"""Trains the main job's GPT with each quantization option and writes the
loss curves side by side, with what each run moved.

  bazel build //models:train_gpt
  python3 models/quantization_curves.py bazel-bin/models/train_gpt OUT_DIR [STUDY]

STUDY is all_gather (--all_gather_quantization none, bf16, int8; the
default) or reduce (--reduce_quantization none, bf16, int8, and int8 for
both). Writes OUT_DIR/curves.csv (model, seed, step, loss per option) and
OUT_DIR/summary.md (final losses, their ratio to float32's, the bytes
all-gathered and reduced by the job's own counters, median tokens/s). Runs
of one seed share initialization and data, so they differ only in how
parameters and gradients travel; three seeds show how far float32 runs
alone land apart.
"""
import json
import os
import re
import statistics
import subprocess
import sys

STUDIES = {
    "all_gather": {
        "none": [],
        "bf16": ["--all_gather_quantization=bf16"],
        "int8": ["--all_gather_quantization=int8"],
    },
    "reduce": {
        "none": [],
        "reduce-bf16": ["--reduce_quantization=bf16"],
        "reduce-int8": ["--reduce_quantization=int8"],
        "both-int8": ["--all_gather_quantization=int8", "--reduce_quantization=int8"],
    },
}
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


def run(binary, model_flags, option_flags, seed, out_dir, name, option):
    metrics = os.path.join(out_dir, f"{name}-seed{seed}-{option}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # The job appends.
    command = [binary, f"--world_size={WORLD}", f"--steps={STEPS}", f"--seed={seed}",
               f"--metrics_jsonl={metrics}"] + option_flags + model_flags
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rank0 = re.search(r"rank 0: .*", output).group(0)
    gathered = re.search(r"all-gathered ([0-9.]+) MiB in (\d+) calls", rank0)
    # The reductions: reduce-scatters, or with --reduce_quantization all-to-alls.
    reduced = float(re.search(r"reduce-scattered ([0-9.]+) MiB", rank0).group(1))
    exchanged = re.search(r"exchanged ([0-9.]+) MiB", rank0)
    reduced += float(exchanged.group(1)) if exchanged else 0.0
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    return {
        "losses": [r["loss"] for r in rows],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[10:]),
        "gathered_mib": float(gathered.group(1)),
        "calls": int(gathered.group(2)),
        "reduced_mib": reduced,
    }


def main():
    binary, out_dir = sys.argv[1], sys.argv[2]
    options = STUDIES[sys.argv[3] if len(sys.argv) > 3 else "all_gather"]
    os.makedirs(out_dir, exist_ok=True)
    results = {}
    for name, flags in MODELS.items():
        for seed in SEEDS:
            for option, option_flags in options.items():  # Interleaved: drift hits all alike.
                r = run(binary, flags, option_flags, seed, out_dir, name, option)
                results[(name, seed, option)] = r
                print(name, seed, option, r["losses"][-1], flush=True)
    with open(os.path.join(out_dir, "curves.csv"), "w") as f:
        f.write("model,seed,step," + ",".join(f"loss_{o}" for o in options) + "\n")
        for name in MODELS:
            for seed in SEEDS:
                for step in range(STEPS):
                    losses = [f"{results[(name, seed, o)]['losses'][step]:.6f}" for o in options]
                    f.write(f"{name},{seed},{step + 1}," + ",".join(losses) + "\n")

    def final(name, seed, option):
        return statistics.mean(results[(name, seed, option)]["losses"][-TAIL:])

    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(f"| model | option | final loss, seeds {SEEDS} (mean of the last {TAIL} "
                f"steps) | mean over seeds | vs float32 | all-gathered per rank | vs float32 "
                f"| reduced per rank | vs float32 | tokens/s (median) |\n")
        f.write("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for name in MODELS:
            base = statistics.mean(final(name, s, "none") for s in SEEDS)
            base_bytes = results[(name, SEEDS[0], "none")]["gathered_mib"]
            base_reduced = results[(name, SEEDS[0], "none")]["reduced_mib"]
            for option in options:
                finals = [final(name, s, option) for s in SEEDS]
                mean = statistics.mean(finals)
                r = results[(name, SEEDS[0], option)]
                speed = statistics.median(results[(name, s, option)]["tokens_per_s"] for s in SEEDS)
                f.write(f"| {name} | {option} | {', '.join(f'{x:.4f}' for x in finals)} | "
                        f"{mean:.4f} | {mean / base - 1:+.2%} | {r['gathered_mib']:.1f} MiB | "
                        f"{r['gathered_mib'] / base_bytes:.3f}x | {r['reduced_mib']:.1f} MiB | "
                        f"{r['reduced_mib'] / base_reduced:.3f}x | {speed:.0f} |\n")


if __name__ == "__main__":
    main()
