#include "fsdp/utilities.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <set>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "c10/util/Exception.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/unit_scheduler.h"

namespace fsdp {
namespace {

// ClipGradNorm after its checks.
at::Tensor ClipCheckedGradNorm(const FullyShardedModel& model, double max_norm, double norm_type) {
  Collectives& group = model.group();
  const bool infinity = std::isinf(norm_type);
  // Sharded units' gradients partition the unsharded ones across ranks;
  // NO_SHARD units' gradients are whole (and equal) on every rank.
  std::vector<at::Tensor> grads;
  at::Tensor sharded = at::zeros({1}, at::kDouble);
  at::Tensor replicated = at::zeros({1}, at::kDouble);
  bool any_sharded = false;  // The same on every rank (the plan is).
  for (const auto& unit : model.units()) {
    if (unit->handle() == nullptr) continue;
    const bool is_sharded = unit->strategy() != ShardingStrategy::kNoShard;
    any_sharded = any_sharded || is_sharded;
    at::Tensor& part = is_sharded ? sharded : replicated;
    // Summed where the unit's gradients are (the compute device, or the
    // host when offloading), then moved to the host once per unit.
    at::Tensor unit_part;
    for (const FlatParamEntry& entry : unit->handle()->entries()) {
      const at::Tensor& g = entry.param.grad();
      if (!g.defined()) continue;
      grads.push_back(g);
      if (g.numel() == 0) continue;
      const at::Tensor n = g.detach().abs().to(at::kDouble);
      const at::Tensor term = infinity ? n.max().view({1}) : n.pow(norm_type).sum().view({1});
      unit_part = !unit_part.defined() ? term
                  : infinity           ? at::maximum(unit_part, term)
                                       : unit_part + term;
    }
    if (unit_part.defined()) {
      unit_part = unit_part.to(at::kCPU);
      part = infinity ? at::maximum(part, unit_part) : part + unit_part;
    }
  }
  if (any_sharded && group.world_size() > 1) {
    CollectiveLabel label(group, "", "clip_grad_norm");
    if (infinity) {
      at::Tensor all = at::empty({group.world_size()}, at::kDouble);
      group.AllGatherIntoTensor(all, sharded)->Wait();
      sharded = all.max().view({1});
    } else {
      group.AllReduce(sharded, ReduceOp::kSum)->Wait();
    }
  }
  const at::Tensor total = infinity ? at::maximum(sharded, replicated)
                                    : (sharded + replicated).pow(1.0 / norm_type);
  const double norm = total.item<double>();
  const double clip_coef = max_norm / (norm + 1e-6);
  if (clip_coef < 1.0) {
    at::NoGradGuard no_grad;
    for (const at::Tensor& g : grads) g.mul_(clip_coef);
  }
  return at::scalar_tensor(norm, at::kFloat);
}

}  // namespace

std::vector<at::Tensor> UniqueParameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> params;
  std::set<const void*> seen;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  return params;
}

absl::StatusOr<at::Tensor> ClipGradNorm(FullyShardedModel& model, double max_norm,
                                        double norm_type) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("ClipGradNorm", ShardAccess::kReadsOnly));
  if (!(norm_type >= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClipGradNorm: norm_type ", norm_type, " must be >= 1 or infinity"));
  }
  if (!(max_norm >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClipGradNorm: max_norm ", max_norm, " must be >= 0"));
  }
  for (const auto& unit : model.units()) {
    if (unit->handle() && unit->handle()->holds_unreduced_gradients()) {
      return absl::FailedPreconditionError(absl::StrCat(
          model.Describe(*unit),
          ": ClipGradNorm inside NoSync or with requires_gradient_sync false (gradients are not "
          "reduced yet)"));
    }
    if (unit->handle() && unit->handle()->has_partial_reduction()) {
      return absl::FailedPreconditionError(absl::StrCat(
          model.Describe(*unit),
          ": ClipGradNorm with requires_all_reduce false (a shard group's gradient sum waits "
          "for the next all-reducing backward)"));
    }
  }
  try {
    return ClipCheckedGradNorm(model, max_norm, norm_type);
  } catch (...) {
    return StatusFromCurrentException();
  }
}

namespace {

void ModulesUnder(const torch::nn::Module& module, std::set<const torch::nn::Module*>& out) {
  for (const auto& child : module.children()) {
    if (out.insert(child.get()).second) ModulesUnder(*child, out);
  }
}

}  // namespace

SummonFullParams::SummonFullParams(FullyShardedModel& model, const SummonOptions& options)
    : SummonFullParams(model, model.units().front()->module(), options) {}

SummonFullParams::SummonFullParams(FullyShardedModel& model, const torch::nn::Module& unit_module,
                                   const SummonOptions& options)
    : model_(model), options_(options), rank_(model.group().rank()) {
  TORCH_CHECK(!(options.writeback && options.rank0_only), "SummonFullParams on rank ", rank_,
              ": writeback and rank0_only together are not supported (the other ranks' "
              "shards would not see rank 0's changes)");
  ThrowIfError(model.RequireIdle("SummonFullParams"));
  std::set<const torch::nn::Module*> under = {&unit_module};
  if (options.recurse) ModulesUnder(unit_module, under);
  bool wrapped = false;
  for (const auto& unit : model.units()) {
    wrapped |= &unit->module() == &unit_module;
    if (under.count(&unit->module()) != 0 && unit->handle() != nullptr) {
      handles_.push_back(unit->handle());
    }
  }
  TORCH_CHECK(wrapped, "SummonFullParams on rank ", rank_, ": no unit wraps the module given (a ",
              unit_module.name(), ")");
  UnitScheduler& scheduler = model.scheduler();
  size_t entered = 0;
  try {
    for (FlatParamHandle* handle : handles_) {
      scheduler.Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kSummonFullParams);
      ++entered;
      scheduler.Unshard(*handle, "summon_full_params");
      if (options.with_grads) scheduler.UnshardGradients(*handle, "summon_full_params");
      if (options.rank0_only && rank_ != 0) {
        scheduler.ReshardGradients(*handle, /*writeback=*/false);
        scheduler.Reshard(*handle);
      }
    }
  } catch (...) {
    // A failed all-gather: no destructor runs, so the units entered so far
    // go back to IDLE and resharded here, without writing anything back.
    handles_.resize(entered);
    options_.writeback = false;
    Leave();
    throw;
  }
}

SummonFullParams::~SummonFullParams() { Leave(); }

void SummonFullParams::Leave() {
  for (FlatParamHandle* handle : handles_) {
    try {
      if (options_.writeback && handle->is_unsharded()) handle->WritebackShard();
      model_.scheduler().ReshardGradients(*handle, options_.writeback);
      model_.scheduler().Reshard(*handle);
      model_.scheduler().Move(*handle, HandleTrainingState::kSummonFullParams,
                              HandleTrainingState::kIdle);
    } catch (const std::exception& e) {
      // Destructors cannot throw; nothing above communicates, so this is a
      // broken invariant worth a loud message.
      std::fprintf(stderr, "SummonFullParams on rank %d: leaving failed: %s\n", rank_, e.what());
    }
  }
}

absl::Status Apply(FullyShardedModel& model, const std::function<void(torch::nn::Module&)>& fn) {
  FSDP_RETURN_IF_ERROR(model.RequireIdle("Apply"));
  try {
    SummonFullParams full(model);
    at::NoGradGuard no_grad;
    // Children before parents, as torch::nn::Module::apply's post-order.
    const auto modules = model.root_->modules(/*include_self=*/true);
    for (auto it = modules.rbegin(); it != modules.rend(); ++it) fn(**it);
  } catch (...) {
    return StatusFromCurrentException();
  }
  return absl::OkStatus();
}

NoSync::NoSync(FullyShardedModel& model) : model_(model), previous_(model.no_sync_) {
  ThrowIfError(model.RequireIdle("NoSync", ShardAccess::kReadsOnly));
  model_.no_sync_ = true;
}

NoSync::~NoSync() { model_.no_sync_ = previous_; }

}  // namespace fsdp
