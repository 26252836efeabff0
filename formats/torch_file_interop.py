"""Python side of torch_file_test: Debian's python3-torch reads what the C++
side wrote and writes what the C++ side reads. Exits non-zero, saying why, on
any difference."""
import collections
import sys

import torch


def expect(condition, message):
    if not condition:
        print("interop check failed: " + message)
        sys.exit(1)


def check_written_by_cpp(path):
    state = torch.load(path, weights_only=True)
    expect(isinstance(state, dict), "not a dict: %r" % type(state))
    expect(list(state.keys()) == ["a.weight", "b.weight", "c.bias", "d.half", "e.shard"],
           "keys %r" % list(state.keys()))
    expect(torch.equal(state["a.weight"], torch.arange(6, dtype=torch.float32).view(2, 3)),
           "a.weight %r" % state["a.weight"])
    expect(state["a.weight"].data_ptr() == state["b.weight"].data_ptr(),
           "tied tensors were stored twice")
    expect(state["c.bias"].dtype == torch.bfloat16 and torch.equal(
        state["c.bias"], torch.full((3,), 1.5, dtype=torch.bfloat16)), "c.bias")
    expect(state["d.half"].dtype == torch.float16 and state["d.half"].shape == (2, 2), "d.half")
    expect(torch.equal(state["e.shard"], torch.tensor([3.0, 4.0])), "e.shard %r" % state["e.shard"])
    # The view's storage was compacted: only its two elements are stored.
    expect(state["e.shard"].storage().size() == 2, "e.shard drags its whole buffer along")
    model = torch.nn.Linear(3, 2)
    model.load_state_dict({"weight": state["a.weight"], "bias": torch.zeros(2)})


def write_for_cpp(directory):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + 10 * i)
    torch.save(model.state_dict(), directory + "/sequential.pt")  # An OrderedDict.
    checkpoint = {
        "model": collections.OrderedDict(
            [("w", torch.arange(4, dtype=torch.float64).view(2, 2).t()),  # Non-contiguous.
             ("half", torch.ones(3, dtype=torch.float16)),
             ("bf", torch.full((2,), 2.5, dtype=torch.bfloat16)),
             ("steps", torch.tensor([7], dtype=torch.int64)),
             ("flag", torch.tensor([True, False])),
             ("big", torch.arange(100000, dtype=torch.float32))]),
        "iter_num": 5,
        "best_val_loss": 1.25,
        "config": {"n_layer": 2, "bias": True, "name": "gpt"},
        "shapes": [1, 2, (3, 4)],
    }
    torch.save(checkpoint, directory + "/checkpoint.pt")
    param = torch.nn.Parameter(torch.ones(2))
    torch.save({"p": param}, directory + "/parameter.pt")


def write_without_crcs(path):
    """torch.save with CRC-32s turned off: every zip record then records 0."""
    if not hasattr(torch.serialization, "set_crc32_options"):
        print("torch %s has no torch.serialization.set_crc32_options" % torch.__version__)
        sys.exit(3)
    torch.serialization.set_crc32_options(False)
    torch.save({"w": torch.arange(1000, dtype=torch.float32).view(10, 100)}, path)


def write_new_dtypes(path):
    """Dtypes without a legacy Storage class: torch.save writes their bytes
    as an UntypedStorage and names the dtype (_rebuild_tensor_v3)."""
    if not hasattr(torch, "float8_e4m3fn"):
        print("torch %s has no float8 dtypes" % torch.__version__)
        sys.exit(3)
    torch.save({"f8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
                "u16": torch.tensor([1, 65535], dtype=torch.uint16),
                "f32": torch.tensor([1.5, 2.5])}, path)


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    {"check_written_by_cpp": check_written_by_cpp, "write_for_cpp": write_for_cpp,
     "write_without_crcs": write_without_crcs, "write_new_dtypes": write_new_dtypes}[mode](path)
