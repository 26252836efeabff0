#!/usr/bin/env python3
"""Peak memory and step time of the main job with and without activation checkpointing.

Runs the training main job (models/train_gpt_main.cc) once per case, each in
its own process tree, on the GPT with a long context, with and without
--activation_checkpointing, at the given world sizes, and prints a Markdown
table: peak RSS per rank, the RSS before the first step, the ratio of the
peaks, tokens per second and the final loss (which must be the same with and
without: checkpointing recomputes, it does not change the math).

glibc's adaptive mmap threshold keeps freed buffers in the heap, so the peak
RSS of a run depends on the order of frees; a fixed threshold
(MALLOC_MMAP_THRESHOLD_) returns every buffer above it to the kernel, and RSS
tracks live memory.

    bazel build //models:train_gpt
    tools/activation_checkpointing_memory.py bazel-bin/models/train_gpt > results.md
"""

import argparse
import os
import re
import subprocess
import sys

MODEL = [
    "--n_layer=6", "--n_head=4", "--n_embd=128", "--block_size=1024", "--batch_size=4",
]
MMAP_THRESHOLD = "65536"


def run_case(binary, world_size, checkpointing, steps, device, model):
    args = [binary, f"--device={device}", f"--world_size={world_size}", f"--steps={steps}",
            f"--log_every={steps}", "--print_plan=false",
            f"--activation_checkpointing={'true' if checkpointing else 'false'}"] + model
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({out.returncode}):\n{text}")
    peaks = [float(m) for m in re.findall(r"peak RSS ([0-9.]+) MiB", text)]
    before = [float(m) for m in re.findall(r"\(([0-9.]+) before the first step", text)]
    rates = re.findall(r"step +\d+/\d+ +loss ([0-9.]+) +(\d+) tokens/s", text)
    if len(peaks) != world_size or len(before) != world_size or not rates:
        sys.exit(f"unexpected output of {' '.join(args)}:\n{text}")
    device_peaks = [float(m) for m in re.findall(r"peak \S+ memory ([0-9.]+) MiB", text)]
    return {"peak": max(peaks), "before": max(before), "loss": rates[-1][0],
            "device_peak": max(device_peaks) if device_peaks else None,
            "tokens_per_s": int(rates[-1][1]), "raw": text}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary", help="the train_gpt binary")
    parser.add_argument("--world_sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--raw", help="also write every run's output here")
    parser.add_argument("--model_flags", default=" ".join(MODEL),
                        help="the model and batch (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="the job's --device; on a GPU the table adds the caching "
                             "allocator's peak")
    args = parser.parse_args()
    rows, raw = [], []
    for w in [int(x) for x in args.world_sizes.split(",")]:
        model = args.model_flags.split()
        plain = run_case(args.binary, w, False, args.steps, args.device, model)
        checkpointed = run_case(args.binary, w, True, args.steps, args.device, model)
        raw += [f"### W={w}, without\n", plain["raw"], f"### W={w}, with\n", checkpointed["raw"]]
        rows.append((w, plain, checkpointed))
    print("| W | peak RSS per rank without (MiB) | with (MiB) | with / without | RSS before "
          "the first step (MiB) | tokens/s without | with | time per step with / without "
          "| final loss without / with |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w, plain, ck in rows:
        print(f"| {w} | {plain['peak']:.1f} | {ck['peak']:.1f} | {ck['peak'] / plain['peak']:.2f} "
              f"| {plain['before']:.1f} / {ck['before']:.1f} | {plain['tokens_per_s']} "
              f"| {ck['tokens_per_s']} | {plain['tokens_per_s'] / ck['tokens_per_s']:.2f} "
              f"| {plain['loss']} / {ck['loss']} |")
    if rows[0][1]["device_peak"] is not None:
        print("\n| W | peak device memory per rank without (MiB) | with (MiB) | with / without |")
        print("|---|---|---|---|")
        for w, plain, ck in rows:
            print(f"| {w} | {plain['device_peak']:.1f} | {ck['device_peak']:.1f} "
                  f"| {ck['device_peak'] / plain['device_peak']:.2f} |")
    print(f"\nDevice: {args.device}. Model flags: {args.model_flags}; {args.steps} steps; "
          f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}.")
    if args.raw:
        with open(args.raw, "w") as f:
            f.write("".join(raw))


if __name__ == "__main__":
    main()
