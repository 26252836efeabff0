// FULL optimizer state dicts (optim/optim_state.h) in the file format of
// Python's torch.save, and read from PyTorch Distributed Checkpoints; laid
// out as PyTorch lays out an optimizer's state:
//
//   {"state": {key: {"step": tensor(3.), "exp_avg": ..., ...}, ...},
//    "param_groups": [{"lr": ..., "betas": (...), ..., "params": [key, ...]}]}
//
// with one of PyTorch's two keyings:
//   - kParameterIndex: torch.optim.Optimizer.state_dict() of an unwrapped
//     model. A parameter's key is its position in the concatenation of the
//     groups' "params" lists. What Optimizer.load_state_dict takes.
//   - kParameterFqn: the parameter's FQN, as FSDP's FULL optim_state_dict
//     and torch.distributed.checkpoint.state_dict.get_optimizer_state_dict
//     write it, and FSDP.optim_state_dict_to_load and
//     set_optimizer_state_dict take it.
//
// Values cross as PyTorch keeps them: a step count is a 0-d float32 tensor
// in the file and an integer here. Group options keep their libtorch names,
// which are PyTorch's (lr, betas, eps, weight_decay, amsgrad, momentum,
// ...), and decoupled_weight_decay tells Adam's state from AdamW's
// (optim/optim_state.h). How PyTorch's kernel runs (foreach, fused,
// capturable) is the reading side's choice: neither written nor read.
// Options that change the update but that libtorch's optimizers do not have
// (maximize, differentiable) are refused when set. A file's param_names
// (PyTorch >= 2.5, optimizers built over named_parameters()) are checked
// against the FQNs its indices are given.
//
// A parameter that never had a gradient has no state in libtorch's
// optimizers, so none is written for it; PyTorch's strict
// set_optimizer_state_dict refuses such a file ("Missing optimizer
// state"), Optimizer.load_state_dict takes it.
#ifndef FSDP_OPTIM_TORCH_OPTIM_FILE_H_
#define FSDP_OPTIM_TORCH_OPTIM_FILE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "formats/dcp.h"
#include "formats/torch_file.h"
#include "optim/optim_state.h"

namespace fsdp {

enum class OptimStateKeys {
  kParameterIndex,  // torch.optim.Optimizer.state_dict().
  kParameterFqn,    // FSDP's FULL optim_state_dict, get_optimizer_state_dict.
};

// Writes `state` to `path` (atomically), keyed as `keys` says. State
// tensors must be on CPU (FullStateDictOptions::offload_to_cpu).
absl::Status SaveTorchOptimStateDict(const std::string& path, const OptimStateDict& state,
                                     OptimStateKeys keys);

// Reads the optimizer state at `path`, written by torch.save or by
// SaveTorchOptimStateDict, in either keying (the keys say which). `entry`
// selects a nested dict ("optimizer" of {"model": ..., "optimizer": ...});
// "" means the top level. A state keyed by index needs `fqn_of_index`:
// the FQN of each position of the groups' concatenated "params" lists (for
// an optimizer over model.parameters(), the model's parameter FQNs in order,
// a tied parameter under its first name); as in Optimizer.load_state_dict,
// an index means its position there, not its value. Fails, naming the file
// and the entry, on anything else: not a torch.save archive (its checks are
// LoadTorchStateDict's), no "state" or "param_groups", a key given twice, a
// key of neither kind or of both, a position without an FQN, state for a
// parameter no group lists, a refused option, a value no libtorch optimizer
// takes.
absl::StatusOr<OptimStateDict> LoadTorchOptimStateDict(
    const std::string& path, const std::string& entry = "",
    const std::vector<std::string>& fqn_of_index = {});

// Reads the optimizer state that a PyTorch Distributed Checkpoint in `dir`
// holds under `key` (dcp.save of {"model": ..., "optim": osd} with osd from
// get_state_dict or get_optimizer_state_dict: key "optim"; "" when osd was
// saved alone), written at any
// world size: every stored value whose recorded path is (key, "state",
// fqn, name) or (key, "param_groups", i, option), each tensor whole.
// Then as LoadTorchOptimStateDict, whose checks apply (`fqn_of_index` for
// a state keyed by index). Fails, naming the directory and the key, on a
// checkpoint without the paths (planner_data), nothing under `key`, a value
// at another path under it, or a missing group.
absl::StatusOr<OptimStateDict> LoadDcpOptimStateDict(
    const std::string& dir, const std::string& key,
    const std::vector<std::string>& fqn_of_index = {});

// This rank's part of it: as LoadDcpOptimStateDict, but the state of a
// parameter in `places` (keyed by FQN) that is shaped like the parameter
// (elementwise: exp_avg, momentum_buffer, ...) is read only for elements
// [lo, hi) of its flattening, 1-D, from the chunks that hold them: a
// SHARDED optimizer state dict for LoadShardedOptimStateDict
// (optim/optim_state.h). Everything else is read whole. Adds the bytes read
// to `*bytes_read` when given.
absl::StatusOr<OptimStateDict> LoadDcpOptimStateDictPart(
    const std::string& dir, const std::string& key,
    const std::map<std::string, ParamShardPlace>& places,
    const std::vector<std::string>& fqn_of_index = {}, int64_t* bytes_read = nullptr);

// Writes a model's FULL state dict and its optimizer's FULL state as a
// Distributed Checkpoint in `dir` laid out as an FSDP2 job's dcp.save of
// {model_key: get_model_state_dict, optim_key: get_optimizer_state_dict}
// (formats/dcp.h's SaveDcpCheckpoint: every tensor whole, atomic), so
// that PyTorch's dcp.load into get_state_dict's dicts, then
// set_state_dict, restores both at any world size. Step counts are written
// as float32 tensors and every group carries PyTorch's own options
// (maximize, foreach, capturable, differentiable, fused) at their defaults,
// which dcp.load expects to find. Tensors must be on CPU.
absl::Status SaveDcpModelAndOptimizer(const std::string& dir, const StateDict& model,
                                      const OptimStateDict& optim,
                                      const std::string& model_key = "model",
                                      const std::string& optim_key = "optim");

// The items SaveDcpModelAndOptimizer writes for `optim` under `optim_key`
// (formats/dcp.h): every state value and tensor at (optim_key, "state",
// fqn, name), every group option at (optim_key, "param_groups", g, option).
std::vector<DcpItem> DcpItemsOfOptimState(const OptimStateDict& optim,
                                          const std::string& optim_key);

}  // namespace fsdp

#endif  // FSDP_OPTIM_TORCH_OPTIM_FILE_H_
