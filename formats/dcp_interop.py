"""Python side of dcp_test: PyTorch's Distributed Checkpoint writes what the
C++ side reads.

  write_plain DIR      dcp.save of a plain state dict (one process), and
                       DIR/expected.pt, the same tensors by torch.save
  write_fsdp2 DIR      one rank of FSDP2 (fully_shard, Gloo; started by our
                       launcher) saving its model's sharded state dict with
                       dcp.save to DIR/ckpt; rank 0 writes DIR/expected.pt
  write_malicious DIR  DIR/.metadata: a pickle that would run a command
                       creating DIR/ran, and a data file beside it
  write_bad DIR        DIR/<case>/ copies of a plain checkpoint whose
                       .metadata lies (chunks outside the tensor, chunks
                       that overlap, a data file outside the directory, a
                       missing storage entry, a compressed chunk), and
                       DIR/newer_python/, whose honest .metadata is pickled
                       as Python 3.12 and 3.13 do

Exits 3 when this torch has no torch.distributed.checkpoint (Debian's 1.13).
"""
import copy
import os
import pickle
import shutil
import sys

import torch


def dcp_or_exit():
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        print("torch %s has no torch.distributed.checkpoint" % torch.__version__)
        sys.exit(3)
    if not hasattr(dcp, "save"):
        print("torch %s has no dcp.save" % torch.__version__)
        sys.exit(3)
    return dcp


def plain_state():
    return {
        "layer.weight": torch.arange(35, dtype=torch.float32).view(5, 7) / 8,
        "layer.bias": torch.linspace(-1, 1, 7, dtype=torch.float64),
        "emb.weight": torch.arange(12, dtype=torch.float32).view(4, 3).to(torch.bfloat16),
        "counts": torch.tensor([3, -1, 7], dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "step": 11,  # Not a tensor: a BytesStorageMetadata entry.
    }


def write_plain(directory):
    dcp = dcp_or_exit()
    state = plain_state()
    dcp.save(state, checkpoint_id=os.path.join(directory, "ckpt"), no_dist=True)
    torch.save({k: v for k, v in plain_state().items() if isinstance(v, torch.Tensor)},
               os.path.join(directory, "expected.pt"))


def write_fsdp2(directory):
    dcp = dcp_or_exit()
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # Odd sizes: shards of dim 0 are uneven at W = 2 and 3.
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3),
                                torch.nn.LayerNorm(3))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) / 10 + i)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=os.path.join(directory, "ckpt"))
    if dist.get_rank() == 0:
        torch.save(expected, os.path.join(directory, "expected.pt"))
    dist.barrier()
    dist.destroy_process_group()


class RunsACommand:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, ("touch '%s'" % self.path,))


def write_malicious(directory):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(RunsACommand(os.path.join(directory, "ran")), f)
    with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 64)


def write_bad(directory):
    dcp_or_exit()
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    source = os.path.join(directory, "source")
    write_plain(source)
    with open(os.path.join(source, "ckpt", ".metadata"), "rb") as f:
        good = pickle.load(f)

    def emit(name, metadata):
        out = os.path.join(directory, name)
        shutil.copytree(os.path.join(source, "ckpt"), out)
        with open(os.path.join(out, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)

    # Not a lie: the same metadata as newer Pythons pickle it (3.12: enum
    # members by value; 3.13: pathlib's classes in pathlib._local).
    import enum
    import io
    import pathlib
    import types

    local = types.ModuleType("pathlib._local")

    def PosixPath(*parts):  # noqa: N802 (the class's name)
        return pathlib.PurePosixPath(*parts)

    PosixPath.__module__, PosixPath.__qualname__ = "pathlib._local", "PosixPath"
    local.PosixPath = PosixPath
    sys.modules["pathlib._local"] = local

    class NewerPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return type(obj), (obj.value,)
            if isinstance(obj, pathlib.PurePath):
                return PosixPath, tuple(obj.parts)
            return NotImplemented

    out = os.path.join(directory, "newer_python")
    shutil.copytree(os.path.join(source, "ckpt"), out)
    buffer = io.BytesIO()
    NewerPickler(buffer).dump(good)
    with open(os.path.join(out, ".metadata"), "wb") as f:
        f.write(buffer.getvalue())

    m = copy.deepcopy(good)
    chunk = m.state_dict_metadata["layer.weight"].chunks[0]
    m.state_dict_metadata["layer.weight"].chunks[0] = ChunkStorageMetadata(
        offsets=chunk.offsets, sizes=torch.Size([6, 7]))
    emit("outside", m)

    m = copy.deepcopy(good)
    entry = m.state_dict_metadata["layer.weight"]
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 7])),
                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([3, 7]))]
    for offsets in ([0, 0], [2, 0]):
        m.storage_data[MetadataIndex("layer.weight", torch.Size(offsets))] = \
            m.storage_data[MetadataIndex("layer.weight", torch.Size([0, 0]))]
    emit("overlap", m)

    m = copy.deepcopy(good)
    index = MetadataIndex("layer.bias", torch.Size([0]))
    info = m.storage_data[index]
    m.storage_data[index] = _StorageInfo("../escape.distcp", info.offset, info.length)
    emit("escape", m)

    m = copy.deepcopy(good)
    del m.storage_data[MetadataIndex("counts", torch.Size([0]))]
    emit("missing", m)

    m = copy.deepcopy(good)
    index = MetadataIndex("layer.bias", torch.Size([0]))
    info = m.storage_data[index]
    m.storage_data[index] = _StorageInfo(info.relative_path, info.offset, info.length,
                                         ["stream_zstd"])
    emit("transformed", m)


def check_load(directory, key):
    dcp = dcp_or_exit()
    expected = torch.load(os.path.join(directory, "expected.pt"))
    state = {key: {name: torch.zeros_like(t) for name, t in expected.items()}}
    dcp.load(state, checkpoint_id=os.path.join(directory, "ckpt"), no_dist=True)
    differ = [name for name, t in expected.items() if not torch.equal(state[key][name], t)]
    if differ:
        print("dcp.load read different values for: %s" % ", ".join(differ))
        sys.exit(1)
    print("dcp.load read all %d tensors exactly" % len(expected))


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "check_load":
        check_load(path, sys.argv[3])
    else:
        {"write_plain": write_plain, "write_fsdp2": write_fsdp2,
         "write_malicious": write_malicious, "write_bad": write_bad}[mode](path)
