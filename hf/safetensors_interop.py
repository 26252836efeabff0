"""Checks our safetensors files against the safetensors package (PyPI).

    safetensors_interop.py write_for_cpp DIR     # files for the C++ test to read
    safetensors_interop.py check_written_by_cpp DIR

Exits 77 when the interpreter has no safetensors (Debian's python3): the
test then skips; tools/test_torch2.sh's venv has it.
"""

import json
import os
import sys

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError as error:
    print(f"safetensors_interop: {error}", file=sys.stderr)
    sys.exit(77)


def tensors():
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": torch.randn(11, 6, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 6, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 6, generator=g).to(torch.float16),
        "lm_head.bias": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }


def write_for_cpp(directory):
    save_file(tensors(), os.path.join(directory, "python.safetensors"), metadata={"format": "pt"})


def check_written_by_cpp(directory):
    expected = tensors()
    path = os.path.join(directory, "cpp.safetensors")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "writer": "fsdp_cpp"}, f.metadata()
        assert sorted(f.keys()) == sorted(expected), f.keys()
        for name, value in expected.items():
            got = f.get_tensor(name)
            assert got.dtype == value.dtype and torch.equal(got, value), name
    # A sharded directory, through transformers' index layout.
    index = json.load(open(os.path.join(directory, "sharded", "model.safetensors.index.json")))
    seen = {}
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(directory, "sharded", file), framework="pt") as f:
            seen[name] = f.get_tensor(name)
    assert sorted(seen) == sorted(expected), sorted(seen)
    for name, value in expected.items():
        assert torch.equal(seen[name], value), name
    total = sum(v.numel() * v.element_size() for v in expected.values())
    assert index["metadata"]["total_size"] == total, index["metadata"]


if __name__ == "__main__":
    {"write_for_cpp": write_for_cpp, "check_written_by_cpp": check_written_by_cpp}[sys.argv[1]](
        sys.argv[2])
