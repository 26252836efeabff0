// AdamW and SGD that step each FSDP unit's flat shard with one set of tensor
// ops, instead of one set per original parameter: FlatShardAdamW and
// FlatShardSGD. They are libtorch's torch::optim::AdamW and
// torch::optim::SGD (subclasses: same options, parameter groups, per-
// parameter state and serialization) with another step().
//
//   fsdp::FlatShardAdamW optimizer(fsdp::UniqueParameters(*model),
//                                  torch::optim::AdamWOptions(3e-4));
//
// Built over the model's parameters after wrapping, as libtorch's. Each step
// finds *runs*: parameters whose data lie end to end in one storage and whose
// gradients lie end to end in one storage, at the same relative offsets.
// After wrapping, the trainable parameters of one unit are such a run: their
// data are consecutive pieces of the unit's flat shard, their gradients
// consecutive pieces of its sharded gradient (NOTE [Flat parameter] in
// fsdp/flat_param_handle.h). A run is stepped as one flat tensor (see
// FlatShardKernel). Parameters of one run may belong to parameter groups
// with different learning rates and weight decays (no decay on biases, say):
// the ops that take those (AdamW's decay and update, SGD's decay and update)
// run once per stretch of one group's consecutive parameters with that
// group's scalars, so kExact stays libtorch's arithmetic for every dtype,
// and kFused passes each stretch to its group's kernel call. Groups with
// other betas, eps, amsgrad, momentum, dampening or nesterov split a run,
// as do different step counts (a parameter that had no gradient on a step):
// correctness never depends on finding runs, only speed does. A parameter
// alone (an unwrapped model's) is a run of one; one whose parameter,
// gradient or state is not contiguous, or whose gradient has another shape
// or dtype, is stepped whole with libtorch's ops, never by the fused
// kernels (which assume dense tensors of one dtype).
//
// State. Each parameter's state is libtorch's AdamWParamState /
// SGDParamState, keyed by the parameter as libtorch keys it, so optimizer
// state dicts and checkpoints (checkpoint/checkpoint.h) work unchanged, and state moves both ways
// between these optimizers and libtorch's. Its tensors are views of one flat buffer per run and
// state key: the step updates the buffer. A state that is not such a view (loaded by
// Optimizer::load, replaced by the caller, or the run's layout changed) is copied into the run's
// buffer at the next step. Serializing a state writes a copy of its own elements only, not the
// whole buffer.
//
// Not supported: sparse gradients (refused by name; libtorch's SGD takes
// them). The step updates a run through views of its storage and then
// advances each parameter's version counter, as libtorch's in-place step
// does (a background checkpoint reads them: checkpoint/async_checkpoint.h).
//
// Thread safety: as libtorch's optimizers (none).
#ifndef FSDP_OPTIM_FLAT_SHARD_OPTIMIZERS_H_
#define FSDP_OPTIM_FLAT_SHARD_OPTIMIZERS_H_

#include <cstdint>
#include <vector>

#include "ATen/core/Tensor.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"
#include "torch/version.h"

namespace fsdp {

// Whether this libtorch has PyTorch's fused AdamW and SGD kernels (2.4 on).
inline constexpr bool kHaveFusedOptimizerKernels = TORCH_VERSION_MAJOR > 2 ||
                                                   (TORCH_VERSION_MAJOR == 2 &&
                                                    TORCH_VERSION_MINOR >= 4);

// How a run is stepped.
enum class FlatShardKernel {
  // libtorch's per-parameter op sequence over the run, in cache-sized
  // chunks: in float32 and float64 the results equal libtorch's bit for bit
  // (tested at W = 1, 2, 3 under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, with
  // one and two parameter groups, on libtorch 1.13 and 2.15). In bfloat16
  // they may differ in the last bit: ATen's own bfloat16 kernels give an
  // element different last bits depending on its position in the tensor
  // (seen, not traced to the kernel; per parameter and per run, positions
  // differ). Tested: within one bfloat16 step. float16 is not tested.
  kExact,
  // PyTorch's fused AdamW / SGD kernels (what torch.optim's fused=True
  // runs), one pass over the elements and one call per set of
  // hyper-parameters: libtorch >= 2.4 only (the constructor refuses it
  // otherwise). Equal to libtorch's up to rounding: the kernels order the
  // same arithmetic differently (tested: within 1e-6 relative in float32).
  kFused,
};

// What the last step() did: how many runs it stepped, and how many of their
// parameters were in a run with others.
struct FlatStepStats {
  int64_t runs = 0;
  int64_t fused_params = 0;  // Parameters stepped as part of a run of two or more.
  int64_t params = 0;        // Parameters stepped.
};

class FlatShardAdamW final : public torch::optim::AdamW {
 public:
  explicit FlatShardAdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          torch::optim::AdamWOptions defaults = {},
                          FlatShardKernel kernel = FlatShardKernel::kExact);
  explicit FlatShardAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {},
                          FlatShardKernel kernel = FlatShardKernel::kExact);

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const FlatStepStats& last_step_stats() const { return stats_; }
  FlatShardKernel kernel() const { return kernel_; }

 private:
  FlatShardKernel kernel_;
  FlatStepStats stats_;
};

class FlatShardSGD final : public torch::optim::SGD {
 public:
  explicit FlatShardSGD(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                        torch::optim::SGDOptions defaults,
                        FlatShardKernel kernel = FlatShardKernel::kExact);
  explicit FlatShardSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults,
                        FlatShardKernel kernel = FlatShardKernel::kExact);

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const FlatStepStats& last_step_stats() const { return stats_; }
  FlatShardKernel kernel() const { return kernel_; }

 private:
  FlatShardKernel kernel_;
  FlatStepStats stats_;
};

}  // namespace fsdp

#endif  // FSDP_OPTIM_FLAT_SHARD_OPTIMIZERS_H_
