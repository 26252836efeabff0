#!/usr/bin/env python3
"""Puts the GPU training-step benchmark's two sides next to each other: the
C++ cases (//models:cuda_step_benchmark, google-benchmark JSON) and
PyTorch's (models/fsdp_step_benchmark.py, JSON lines), as a markdown table
per model and world size. Ratios are ours / PyTorch's: below 1 is faster
(step time) or smaller (memory).

  tools/gpu_step_table.py CPP_JSON [CPP_JSON...] PYTORCH_JSONL
"""
import json
import sys

# Our case -> PyTorch's cases with the same sharding, precision and offload.
COUNTERPARTS = {
    "unwrapped": ["unwrapped"],
    # libtorch's per-parameter AdamW against PyTorch's fused one.
    "unwrapped:per_parameter_adamw": ["unwrapped"],
    "full_shard": ["fsdp:full_shard", "fully_shard:full_shard"],
    "shard_grad_op": ["fsdp:shard_grad_op", "fully_shard:shard_grad_op"],
    "no_shard": ["fsdp:no_shard"],
    "full_shard:bf16": ["fsdp:full_shard:bf16", "fully_shard:full_shard:bf16"],
    "full_shard:offload": ["fsdp:full_shard:offload", "fully_shard:full_shard:offload"],
    "full_shard:process_group": ["fsdp:full_shard", "fully_shard:full_shard"],
    "full_shard:staged": ["fsdp:full_shard", "fully_shard:full_shard"],
    "full_shard:bf16:staged": ["fsdp:full_shard:bf16", "fully_shard:full_shard:bf16"],
}


def split_name(name):
    """BM_X/model/case/W:n -> (model, case, n); google-benchmark may append
    /iterations:k, /manual_time and the like after the world size."""
    parts = name.split("/")
    world = next(i for i, part in enumerate(parts) if part.startswith("W:"))
    return parts[1], "/".join(parts[2:world]), int(parts[world][2:])


def load_cpp(path):
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    out = {}
    for run in runs:
        if run.get("run_type", "iteration") != "iteration":
            continue
        key = split_name(run["name"])
        if "error_message" in run:
            out[key] = {"error": run["error_message"]}
        else:
            out[key] = {k: run[k] for k in ("median_ms", "p10_ms", "p90_ms",
                                             "peak_allocated_MiB", "peak_reserved_MiB",
                                             "model_state_MiB") if k in run}
    return out


def load_pytorch(path):
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                result = json.loads(line)
                out[split_name(result["name"])] = result
    return out


def cell(result, key, fmt):
    if result is None:
        return "not run"
    if "error" in result:
        return "failed"
    return fmt % result[key] if key in result else "-"


def step(result):
    """The median, and the 10th-90th percentile spread when there is one."""
    median = cell(result, "median_ms", "%.2f")
    if result and "p10_ms" in result and "p90_ms" in result:
        return "%s (%.2f-%.2f)" % (median, result["p10_ms"], result["p90_ms"])
    return median


def memory(result):
    allocated = cell(result, "peak_allocated_MiB", "%.0f")
    if result and "peak_reserved_MiB" in result:
        return "%s (%.0f)" % (allocated, result["peak_reserved_MiB"])
    return allocated


def ratio(ours, theirs, key):
    if not ours or not theirs or not theirs.get(key) or key not in ours:
        return "-"
    return "%.2f" % (ours[key] / theirs[key])


def main():
    cpp = {}
    for path in sys.argv[1:-1]:
        cpp.update(load_cpp(path))
    pytorch = load_pytorch(sys.argv[-1])
    versions = sorted({r["torch"] for r in pytorch.values() if "torch" in r})
    print("PyTorch %s. Step: median of the timed steps, ms (10th-90th percentile in "
          "parentheses). Memory: peak allocated MiB during the timed steps (reserved in "
          "parentheses). Ratio: ours / PyTorch's, of the medians." % ", ".join(versions))
    for model, world in sorted({(m, w) for m, _, w in list(cpp) + list(pytorch)}):
        print("\n### %s, W=%d\n" % (model, world))
        print("| ours | step ms | peak MiB | PyTorch | step ms | peak MiB | step ratio | "
              "memory ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for case, theirs in COUNTERPARTS.items():
            ours = cpp.get((model, case, world))
            for their_case in theirs:
                other = pytorch.get((model, their_case, world))
                print("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
                    case, step(ours), memory(ours),
                    their_case, step(other), memory(other),
                    ratio(ours, other, "median_ms"), ratio(ours, other, "peak_allocated_MiB")))
    failures = [(k, r["error"]) for k, r in list(cpp.items()) + list(pytorch.items())
                if "error" in r]
    if failures:
        print("\nFailed cases:")
        for key, error in failures:
            print("- %s: %s" % ("/".join(map(str, key)), error))


if __name__ == "__main__":
    main()
