#include "fsdp/fully_shard.h"

#include <optional>
#include <utility>

#include "ATen/native/Resize.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "c10/core/GradMode.h"
#include "c10/core/StreamGuard.h"
#include "c10/util/Exception.h"
#include "fsdp/cross_rank_checks.h"
#include "fsdp/flat_param_handle.h"
#include "fsdp/unit_init.h"
#include "fsdp/unit_scheduler.h"
#include "torch/csrc/autograd/engine.h"
#include "torch/csrc/autograd/function.h"
#include "torch/csrc/autograd/function_hook.h"
#include "torch/csrc/autograd/variable.h"

namespace fsdp {
namespace {

// Runs `fn` after a gradient accumulator has added a gradient to .grad.
class AccumulatorPostHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit AccumulatorPostHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

absl::Status DeferParameterAllocation(torch::nn::Module& module) {
  // Every parameter is checked before any is released.
  for (const auto& item : module.named_parameters()) {
    const at::Tensor& t = item.value();
    if (!t.device().is_cpu() || !t.is_contiguous()) {
      return absl::InvalidArgumentError(
          absl::StrCat("DeferParameterAllocation: parameter '", item.key(), "' is ",
                       t.device().is_cpu() ? "not contiguous" : "not on the CPU",
                       "; parameters must be contiguous CPU tensors"));
    }
  }
  for (const at::Tensor& t : module.parameters()) {
    at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
  }
  for (const at::Tensor& t : module.buffers()) {
    if (t.defined() && t.device().is_cpu() && t.is_contiguous()) {
      at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
    }
  }
  return absl::OkStatus();
}

void FullyShardedModel::HoldShards(std::function<void()> wait) {
  WaitForShardHold();
  shard_hold_ = std::move(wait);
}

void FullyShardedModel::WaitForShardHold() const {
  if (!shard_hold_) return;
  std::function<void()> wait = std::exchange(shard_hold_, nullptr);
  wait();
}

absl::Status FullyShardedModel::RequireIdle(const std::string& what, ShardAccess access) const {
  if (training_state_ == ModelTrainingState::kIdle && access == ShardAccess::kMayWrite) {
    WaitForShardHold();
  }
  if (training_state_ != ModelTrainingState::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " on rank ", group().rank(),
                     ": the model is in forward or backward; call it between steps"));
  }
  for (const auto& unit : units_) {
    if (unit->handle_ != nullptr &&
        unit->handle_->training_state() != HandleTrainingState::kIdle) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " on rank ", group().rank(), ": unit '", UnitName(unit->fqn_),
          "' is in state ", HandleTrainingStateName(unit->handle_->training_state()),
          " (inside SummonFullParams?)"));
    }
  }
  return absl::OkStatus();
}

const char* ModelTrainingStateName(ModelTrainingState state) {
  return state == ModelTrainingState::kIdle ? "IDLE" : "FORWARD_BACKWARD";
}

FullyShardedModel::FullyShardedModel(std::shared_ptr<torch::nn::Module> root,
                                     const ProcessGroups& groups, const FsdpOptions& options)
    : root_(std::move(root)), groups_(groups), options_(options) {}

FsdpUnit::FsdpUnit() = default;
FsdpUnit::~FsdpUnit() = default;

FullyShardedModel::~FullyShardedModel() {
  std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>> registered;
  for (auto& unit : units_) {
    registered.emplace_back(unit->module_, unit.get());
    for (auto& [node, key] : unit->accumulators_) node->del_post_hook(key);
  }
  UnregisterUnits(registered);
}

namespace {

// Each unit's parameters as its handle's entries. All units are checked
// before any handle swaps parameters to shards, so that a failed Wrap
// leaves the model as it was.
absl::StatusOr<std::vector<std::vector<FlatParamEntry>>> CheckedEntries(const WrapPlan& plan,
                                                                       Collectives& group) {
  std::vector<std::vector<FlatParamEntry>> entries;
  for (const PlannedUnit& planned : plan.units) {
    entries.emplace_back();
    for (size_t i = 0; i < planned.params.size(); ++i) {
      entries.back().push_back({planned.param_fqns[i], planned.params[i]});
    }
    if (entries.back().empty()) continue;
    FSDP_RETURN_IF_ERROR(FlatParamHandle::CheckParams(UnitName(planned.fqn), entries.back(), group));
  }
  return entries;
}

// The device the units compute on: device_id when set, else that of the
// last unit's parameters (CPU for a model without any).
c10::Device ComputeDevice(const std::vector<std::vector<FlatParamEntry>>& entries,
                          const FsdpOptions& options) {
  c10::Device device(c10::DeviceType::CPU);
  for (const auto& unit_entries : entries) {
    if (!unit_entries.empty()) device = unit_entries.front().param.device();
  }
  if (options.device_id) device = *options.device_id;
  return device;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FullyShardedModel>> FullyShardedModel::Wrap(
    std::shared_ptr<torch::nn::Module> root, const ProcessGroups& groups,
    const FsdpOptions& options, const WrapPolicy& policy) {
  if (!root) return absl::InvalidArgumentError("FullyShardedModel::Wrap: root is null");
  if (groups.shard == nullptr) {
    return absl::InvalidArgumentError("FullyShardedModel::Wrap: ProcessGroups::shard is null");
  }
  Collectives& group = *groups.shard;
  // Ranks can fail differently, so every error names the rank.
  const std::string who = absl::StrCat("rank ", group.rank(), " of ", group.world_size(), ": ");
  auto on_rank = [&who](const absl::Status& failed) {
    return absl::Status(failed.code(), absl::StrCat(who, failed.message()));
  };
  if (absl::Status valid = ValidateFsdpOptions(options); !valid.ok()) return on_rank(valid);
  if (absl::Status fit = ValidateProcessGroups(groups, options); !fit.ok()) return on_rank(fit);
  absl::StatusOr<WrapPlan> plan = PlanWrap(*root, group.world_size(), options, policy);
  if (!plan.ok()) return on_rank(plan.status());
  if (absl::Status device_ok = CheckDeviceId(options, *plan); !device_ok.ok()) {
    return on_rank(device_ok);
  }
  std::unique_ptr<FullyShardedModel> model(new FullyShardedModel(root, groups, options));
  absl::StatusOr<std::vector<std::vector<FlatParamEntry>>> entries = CheckedEntries(*plan, group);
  if (!entries.ok()) return entries.status();
  const c10::Device device = ComputeDevice(*entries, options);
  try {
    model->scheduler_ = std::make_unique<UnitScheduler>(groups, model->options_, device);
  } catch (...) {
    const absl::Status failed = StatusFromCurrentException();
    return absl::Status(failed.code(), absl::StrCat(who, "cannot compute on ", device.str(),
                                                    ": ", failed.message()));
  }
  ModulesByName modules;
  for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    modules[item.key()] = item.value().get();
  }
  for (size_t u = 0; u < plan->units.size(); ++u) {
    const PlannedUnit& planned = plan->units[u];
    auto unit = std::make_unique<FsdpUnit>();
    unit->fqn_ = planned.fqn;
    unit->module_ = planned.module;
    unit->is_root_ = u == 0;
    unit->options_ = ResolveUnitOptions(planned, options, groups);
    unit->model_ = model.get();
    if (!(*entries)[u].empty()) {
      // Deferred parameters get memory and values just before their handle
      // shards them: one unit at a time.
      if (absl::Status ready = InitUnitParams(planned, modules, options, groups); !ready.ok()) {
        return on_rank(ready);
      }
      auto handle = FlatParamHandle::Create(UnitName(planned.fqn), std::move((*entries)[u]), group,
                                            unit->options_);
      if (!handle.ok()) return handle.status();
      unit->handle_ = std::move(*handle);
    }
    model->units_.push_back(std::move(unit));
  }
  if (absl::Status buffers_ok =
          InitBuffers(*root, modules, *plan, options, groups, model->buffer_full_dtypes_);
      !buffers_ok.ok()) {
    return on_rank(buffers_ok);
  }
  for (PlannedUnit& planned : plan->units) planned.params.clear();  // No extra references.
  model->plan_ = std::move(*plan);
  std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>> registered;
  for (const auto& unit : model->units_) registered.emplace_back(unit->module_, unit.get());
  if (std::optional<size_t> taken = RegisterUnits(registered)) {
    return absl::AlreadyExistsError(
        absl::StrCat(who, "module '", UnitName(registered[*taken].second->fqn_),
                     "' was wrapped by another model while this one was being wrapped"));
  }
  return model;
}

std::string FullyShardedModel::Describe(const FsdpUnit& unit) const {
  return absl::StrCat("unit '", UnitName(unit.fqn_), "' on rank ",
                      group().rank(), " of ", group().world_size());
}

int64_t FullyShardedModel::FullParamBytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) {
    if (unit->handle_) bytes += unit->handle_->full_param_bytes();
  }
  return bytes;
}

void FullyShardedModel::LazyInit() {
  std::vector<UnitSignature> units;
  for (const auto& unit : units_) {
    units.push_back(SignatureOf(unit->fqn_, unit->options(),
                                unit->handle_ ? &unit->handle_->layout() : nullptr));
  }
  CheckSameWrapOnEveryRank(groups_, options_, units);
  if (groups_.post_forward != nullptr) CheckPostForwardGroup(group(), *groups_.post_forward);
  initialized_ = true;
}

void FullyShardedModel::ValidateKeptFullParams() {
  // Which units keep full parameters is the same on every rank (the same
  // settings and Unshard calls), and so is whether this all-reduce runs.
  std::vector<FlatParamHandle*> kept;
  for (const auto& unit : units_) {
    FlatParamHandle* handle = unit->handle_.get();
    if (handle == nullptr) continue;
    scheduler_->WaitForUnshard(*handle);  // An Unshard not waited for.
    if (handle->holds_kept_full()) kept.push_back(handle);
  }
  if (kept.empty()) return;
  at::Tensor stale = at::zeros({static_cast<int64_t>(kept.size())}, at::kDouble);
  for (size_t i = 0; i < kept.size(); ++i) {
    if (!kept[i]->KeptFullMatchesShard()) stale[i] = 1.0;
  }
  {
    CollectiveLabel label(group(), "", "kept full parameters check");
    group().AllReduce(stale, ReduceOp::kSum)->Wait();
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    if (stale[i].item<double>() == 0) continue;
    scheduler_->Reshard(*kept[i]);
    if (options_.debug_log) {
      options_.debug_log(absl::StrCat("unit '", kept[i]->unit_name(),
                                      "': kept full parameters are stale (a shard was written "
                                      "since they were gathered); gathering again"));
    }
  }
}

void FullyShardedModel::PreForward(FsdpUnit& unit) {
  if (!initialized_) LazyInit();
  forward_ran_ = true;
  if (training_state_ == ModelTrainingState::kIdle) {
    ValidateKeptFullParams();
    // A forward that no backward followed leaves inputs counted.
    for (auto& each : units_) each->input_gradients_pending_ = 0;
  }
  unit.forward_span_ = TraceSpan(options_.trace, "forward", UnitName(unit.fqn_));
  FlatParamHandle* handle = unit.handle_.get();
  if (handle == nullptr) {
    SetModelState(ModelTrainingState::kForwardBackward);
    if (!order_recorded_) pre_forward_order_.push_back(IndexOf(unit));
    if (unit.forward_prefetch_explicit_) Prefetch(unit.forward_prefetch_);
    return;
  }
  CheckTrainableAsWrapped(unit);
  scheduler_->Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kForward);
  SetModelState(ModelTrainingState::kForwardBackward);  // Only once admitted.
  if (!order_recorded_) pre_forward_order_.push_back(IndexOf(unit));
  scheduler_->Unshard(*handle, UnshardPhase(*handle));
  if (options_.forward_prefetch || unit.forward_prefetch_explicit_) {
    Prefetch(unit.forward_prefetch_);
  }
  HookGradientAccumulators(unit);
}

void FullyShardedModel::CheckTrainableAsWrapped(const FsdpUnit& unit) const {
  // The flat parameter's segments, and so which gradients are reduced and
  // kept, were fixed at wrap time.
  const FlatParamHandle& handle = *unit.handle_;
  for (size_t i = 0; i < handle.entries().size(); ++i) {
    const bool now = handle.entries()[i].param.requires_grad();
    TORCH_CHECK(now == handle.layout().params()[i].trainable, Describe(unit), ": '",
                handle.layout().params()[i].fqn, "' has requires_grad=", now ? "true" : "false",
                " but was ", now ? "frozen" : "trainable",
                " when the model was wrapped; which parameters train is fixed at wrap time "
                "(wrap again to change it)");
  }
}

void FullyShardedModel::HookGradientAccumulators(FsdpUnit& unit) {
  // Autograd forgets a parameter's accumulator when set_data gives it
  // another dtype or device (mixed precision's low-precision copy, CPU
  // offload's host shard), and this forward's graph then holds a new one
  // without our hook: every such unit would reduce only at the end of
  // backward. So the hooks are checked on every forward and moved to the
  // accumulators this forward uses. Created while unsharded: an
  // accumulator records the parameter's shape, dtype and device when it is
  // made, and backward delivers full-shape gradients.
  const std::vector<FlatParamEntry>& entries = unit.handle_->entries();
  bool current = !unit.accumulators_.empty();
  size_t k = 0;
  for (const FlatParamEntry& entry : entries) {
    if (!current) break;
    if (!entry.param.requires_grad()) continue;
    current = k < unit.accumulators_.size() &&
              torch::autograd::impl::try_get_grad_accumulator(entry.param) ==
                  unit.accumulators_[k].first;
    ++k;
  }
  if (current) return;
  for (auto& [node, key] : unit.accumulators_) node->del_post_hook(key);
  unit.accumulators_.clear();
  unit.holds_frozen_params_ = false;  // NOTE [Frozen parameters in backward].
  for (const FlatParamEntry& entry : entries) {
    if (!entry.param.requires_grad()) {  // Full size here: an empty one computes nothing.
      unit.holds_frozen_params_ = unit.holds_frozen_params_ || entry.param.numel() > 0;
      continue;
    }
    FsdpUnit::AccumulatorPtr node = torch::autograd::impl::grad_accumulator(entry.param);
    FsdpUnit* u = &unit;
    const uintptr_t key = node->add_post_hook(
        std::make_unique<AccumulatorPostHook>([this, u] { PostBackward(*u); }));
    unit.accumulators_.emplace_back(std::move(node), key);
  }
}

void FullyShardedModel::PostForward(FsdpUnit& unit, const std::vector<at::Tensor>& outputs) {
  unit.forward_span_.End();
  if (!order_recorded_) {
    post_forward_order_.push_back(IndexOf(unit));
    if (unit.is_root_) RecordExecutionOrder();
  }
  bool backward_follows = false;
  if (c10::GradMode::is_enabled()) {
    for (const at::Tensor& out : outputs) {
      backward_follows = backward_follows || (out.defined() && out.requires_grad());
    }
  }
  FlatParamHandle* handle = unit.handle_.get();
  if (handle != nullptr) {
    scheduler_->Move(*handle, HandleTrainingState::kForward, HandleTrainingState::kIdle);
    // FULL_SHARD frees parameters after forward; the root keeps them, since
    // its backward starts right away (as in PyTorch). Without a backward to
    // come, every strategy frees them now.
    if (!backward_follows) {
      scheduler_->Reshard(*handle);
    } else if (ReshardsAfterForward(unit.strategy()) && !unit.is_root_) {
      scheduler_->ReshardAfterForward(*handle);  // Keeps a piece with a post-forward group.
    }
  }
  if (!backward_follows) {
    if (unit.is_root_) {
      // No backward comes to reshard what inner units kept for theirs (an
      // inner output needed gradients, the root's does not): full
      // parameters (SHARD_GRAD_OP) and post-forward pieces, which would
      // outlive writes to their shards between steps.
      for (auto& u : units_) {
        FlatParamHandle* h = u->handle_.get();
        if (h == nullptr) continue;
        scheduler_->DiscardPrefetch(*h);
        if (h->training_state() == HandleTrainingState::kIdle &&
            (h->is_unsharded() || h->holds_post_forward_shard())) {
          scheduler_->Reshard(*h);
        }
      }
      SetModelState(ModelTrainingState::kIdle);
    }
    return;
  }
  FsdpUnit* u = &unit;
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    // On TensorBase: autograd also calls a tensor's hooks when its gradient
    // is undefined (an output nothing used), which libtorch 1.13's at::Tensor
    // hook wrapper asserts against. The unit's backward may still run then
    // (through the graph behind that output), so it unshards all the same.
    static_cast<const at::TensorBase&>(out).register_hook(
        [this, u](const at::TensorBase&) -> at::TensorBase {
          PreBackward(*u);
          return at::TensorBase();  // The gradient unchanged.
        });
  }
}

void FullyShardedModel::PreBackward(FsdpUnit& unit) {
  if (unit.pre_backward_done_) return;
  unit.pre_backward_done_ = true;
  unit.backward_span_ = TraceSpan(options_.trace, "backward", UnitName(unit.fqn_));
  if (!backward_callback_queued_) {
    backward_callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { FinishBackward(); });
  }
  FlatParamHandle* handle = unit.handle_.get();
  if (handle == nullptr) {
    if (unit.backward_prefetch_explicit_) Prefetch(unit.backward_prefetch_);
    return;
  }
  scheduler_->Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kBackwardPre);
  scheduler_->Unshard(*handle, UnshardPhase(*handle));
  handle->PrepareGradientsForBackward();
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre ||
      unit.backward_prefetch_explicit_) {
    Prefetch(unit.backward_prefetch_);
  }
}

void FullyShardedModel::PostBackward(FsdpUnit& unit) {
  FlatParamHandle* handle = unit.handle_.get();
  TORCH_CHECK(handle->training_state() == HandleTrainingState::kBackwardPre, Describe(unit),
              ": a gradient arrived before the unit's pre-backward hook ran (state ",
              HandleTrainingStateName(handle->training_state()),
              "); was one of its parameters used outside its forward?");
  if (++unit.gradients_ready_ < static_cast<int>(unit.accumulators_.size())) return;
  scheduler_->Move(*handle, HandleTrainingState::kBackwardPre, HandleTrainingState::kBackwardPost);
  ReduceOrKeep(unit);
  // NOTE [Frozen parameters in backward]: the trainable parameters' last
  // gradient does not end the unit's backward when it also holds frozen
  // ones: the gradient of the unit's input through a frozen weight (a LoRA
  // adapter's base, models/lora.h) may still be computed after every
  // adapter's gradient, from the frozen weight saved for backward. Every
  // other use of a frozen weight in backward lies on the way to a
  // trainable parameter's gradient, so once those and the inputs'
  // gradients are done the unit is finished: UnitForward::Input passes
  // each forward input that requires grad through an identity node whose
  // backward calls InputGradientDone, and whichever of the two comes last
  // reshards (FSDP2's RegisterPostBackwardFunction). A unit whose inputs
  // need no gradient has none pending and reshards here. Without this, a
  // LoRA model's units stayed unsharded to the end of backward: the whole
  // model at once.
  if (!unit.holds_frozen_params_ || unit.input_gradients_pending_ == 0) {
    ReshardAfterBackward(unit);
  }
  unit.backward_span_.End();
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost &&
      !unit.backward_prefetch_explicit_) {
    Prefetch(unit.backward_prefetch_);
  }
}

void FullyShardedModel::InputGradientDone(FsdpUnit& unit) {
  if (--unit.input_gradients_pending_ > 0) return;
  // Before its trainable gradients are all in, PostBackward reshards later.
  FlatParamHandle* handle = unit.handle_.get();
  if (handle == nullptr || handle->training_state() != HandleTrainingState::kBackwardPost) return;
  ReshardAfterBackward(unit);
}

void FullyShardedModel::ReshardAfterBackward(FsdpUnit& unit) {
  FlatParamHandle& handle = *unit.handle_;
  // A reducing backward always reshards: its gradient shards reach .grad
  // only then, and the optimizer step that follows writes the shards.
  const bool keep = !unit.reshard_after_backward_ &&
                    (!handle.layout().has_trainable_params() || handle.holds_unreduced_gradients());
  if (keep && handle.is_unsharded()) {
    scheduler_->ReshardKeepingFull(handle);
  } else if (!(keep && handle.holds_kept_full())) {  // Kept by the post hook already.
    scheduler_->Reshard(handle);
  }
}

void FullyShardedModel::ReduceOrKeep(FsdpUnit& unit) {
  FlatParamHandle& handle = *unit.handle_;
  if (!handle.layout().has_trainable_params()) return;  // A frozen unit has no gradients.
  if (no_sync_ || !unit.requires_gradient_sync_) {
    handle.KeepGradientsUnreduced();
    return;
  }
  scheduler_->ReduceGradients(handle, unit.requires_all_reduce_);
}

absl::StatusOr<std::vector<FsdpUnit*>> FullyShardedModel::UnitsOf(const char* caller,
                                                                  const torch::nn::Module& module,
                                                                  bool recurse) {
  const FsdpUnit* target = UnitOf(module);
  if (target == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(caller, ": module '", module.name(),
                     "' is not a unit of this model (the root or a module the policy wrapped)"));
  }
  const std::string prefix = target->fqn_.empty() ? "" : target->fqn_ + ".";
  std::vector<FsdpUnit*> units;
  for (auto& unit : units_) {
    const bool inside = unit.get() == target || (recurse && absl::StartsWith(unit->fqn_, prefix));
    if (inside) units.push_back(unit.get());
  }
  return units;
}

absl::Status FullyShardedModel::SetRequiresGradientSync(
    const torch::nn::Module& module, const RequiresGradientSyncOptions& options) {
  FSDP_RETURN_IF_ERROR(RequireIdle("SetRequiresGradientSync", ShardAccess::kReadsOnly));
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units,
                        UnitsOf("SetRequiresGradientSync", module, options.recurse));
  for (FsdpUnit* unit : units) unit->requires_gradient_sync_ = options.requires_gradient_sync;
  return absl::OkStatus();
}

absl::Status FullyShardedModel::SetRequiresAllReduce(const torch::nn::Module& module,
                                                     const RequiresAllReduceOptions& options) {
  FSDP_RETURN_IF_ERROR(RequireIdle("SetRequiresAllReduce", ShardAccess::kReadsOnly));
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units,
                        UnitsOf("SetRequiresAllReduce", module, options.recurse));
  for (FsdpUnit* unit : units) unit->requires_all_reduce_ = options.requires_all_reduce;
  return absl::OkStatus();
}

absl::Status FullyShardedModel::SetReshardAfterBackward(
    const torch::nn::Module& module, const ReshardAfterBackwardOptions& options) {
  FSDP_RETURN_IF_ERROR(RequireIdle("SetReshardAfterBackward", ShardAccess::kReadsOnly));
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units,
                        UnitsOf("SetReshardAfterBackward", module, options.recurse));
  for (FsdpUnit* unit : units) unit->reshard_after_backward_ = options.reshard_after_backward;
  return absl::OkStatus();
}

absl::Status FullyShardedModel::SetGradientDivideFactor(
    const torch::nn::Module& module, const GradientDivideFactorOptions& options) {
  const std::optional<double> factor = options.factor;
  FSDP_RETURN_IF_ERROR(RequireIdle("SetGradientDivideFactor", ShardAccess::kReadsOnly));
  if (factor && !(*factor > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetGradientDivideFactor: the factor must be positive, got ", *factor));
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units,
                        UnitsOf("SetGradientDivideFactor", module, options.recurse));
  for (FsdpUnit* unit : units) {
    if (unit->handle_ != nullptr) unit->handle_->SetGradientDivideFactor(factor);
  }
  return absl::OkStatus();
}

absl::StatusOr<UnshardHandle> FullyShardedModel::Unshard(const torch::nn::Module& module) {
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units, UnitsOf("Unshard", module, false));
  // The cross-rank checks come before the first all-gather, as in forward;
  // they throw on every rank alike.
  if (!initialized_) {
    try {
      LazyInit();
    } catch (...) {
      return StatusFromCurrentException();
    }
  }
  FsdpUnit& unit = *units.front();
  if (backward_callback_queued_) {
    return absl::FailedPreconditionError(
        absl::StrCat("Unshard on rank ", group().rank(),
                     ": the model is in backward; unshard between steps "
                     "or in forward"));
  }
  FlatParamHandle* handle = unit.handle_.get();
  if (handle != nullptr && handle->training_state() != HandleTrainingState::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Unshard on rank ", group().rank(), ": unit '", UnitName(unit.fqn_), "' is in state ",
        HandleTrainingStateName(handle->training_state()), "; unshard it before its forward"));
  }
  // From a copy of the shard: a write before the forward must reach no
  // rank's result, so that ValidateKeptFullParams sees it.
  if (handle != nullptr) {
    scheduler_->IssueUnshard(*handle, UnshardPhase(*handle), /*snapshot=*/true);
  }
  return UnshardHandle(this, &unit);
}

void UnshardHandle::Wait() {
  if (unit_->handle() != nullptr) model_->scheduler_->WaitForUnshard(*unit_->handle());
}

absl::Status FullyShardedModel::Reshard(const torch::nn::Module& module, bool recurse) {
  FSDP_RETURN_IF_ERROR(RequireIdle("Reshard", ShardAccess::kReadsOnly));
  FSDP_ASSIGN_OR_RETURN(std::vector<FsdpUnit*> units, UnitsOf("Reshard", module, recurse));
  for (FsdpUnit* unit : units) {
    if (unit->handle_ == nullptr) continue;
    scheduler_->DiscardPrefetch(*unit->handle_);
    scheduler_->Reshard(*unit->handle_);
  }
  return absl::OkStatus();
}

FsdpUnit* FullyShardedModel::UnitOf(const torch::nn::Module& module) const {
  for (const auto& unit : units_) {
    if (unit->module_ == &module) return unit.get();
  }
  return nullptr;
}

absl::Status FullyShardedModel::SetModulesToPrefetch(
    const char* caller, const torch::nn::Module& unit_module,
    const std::vector<const torch::nn::Module*>& modules, bool forward) {
  FSDP_RETURN_IF_ERROR(RequireIdle(caller, ShardAccess::kReadsOnly));
  FsdpUnit* unit = UnitOf(unit_module);
  if (unit == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(caller, ": module '", unit_module.name(),
                     "' is not a unit of this model (the root or a module the policy wrapped)"));
  }
  std::vector<int> indices;
  for (size_t i = 0; i < modules.size(); ++i) {
    const FsdpUnit* target = modules[i] == nullptr ? nullptr : UnitOf(*modules[i]);
    if (target == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          caller, ": modules[", i, "] ('", modules[i] == nullptr ? "null" : modules[i]->name(),
          "') is not a unit of this model (the root or a module the policy wrapped)"));
    }
    indices.push_back(IndexOf(*target));
  }
  (forward ? unit->forward_prefetch_ : unit->backward_prefetch_) = std::move(indices);
  (forward ? unit->forward_prefetch_explicit_ : unit->backward_prefetch_explicit_) = true;
  return absl::OkStatus();
}

absl::Status FullyShardedModel::SetModulesToForwardPrefetch(
    const torch::nn::Module& unit_module, const std::vector<const torch::nn::Module*>& modules) {
  return SetModulesToPrefetch("SetModulesToForwardPrefetch", unit_module, modules, true);
}

absl::Status FullyShardedModel::SetModulesToBackwardPrefetch(
    const torch::nn::Module& unit_module, const std::vector<const torch::nn::Module*>& modules) {
  return SetModulesToPrefetch("SetModulesToBackwardPrefetch", unit_module, modules, false);
}

std::string FullyShardedModel::UnshardPhase(const FlatParamHandle& handle) const {
  // A prefetch issued while backward runs serves backward: the end-of-
  // backward callback is queued by then.
  const bool backward = handle.training_state() == HandleTrainingState::kBackwardPre ||
                        (handle.training_state() == HandleTrainingState::kIdle &&
                         backward_callback_queued_);
  return backward ? "backward" : "forward";
}

void FullyShardedModel::FinishBackward() {
  // A root without a forward scope never ends the first forward for us.
  if (!order_recorded_) RecordExecutionOrder();
  // Units some of whose parameters got no gradient have not reduced yet;
  // every rank reaches here with the same units in that state, in the same
  // (pre-)order.
  for (auto& unit : units_) {
    FlatParamHandle* handle = unit->handle_.get();
    if (handle != nullptr) {
      if (handle->training_state() == HandleTrainingState::kBackwardPre) {
        scheduler_->Move(*handle, HandleTrainingState::kBackwardPre,
                         HandleTrainingState::kBackwardPost);
        ReduceOrKeep(*unit);
        unit->backward_span_.End();
      }
      scheduler_->DiscardPrefetch(*handle);  // A prefetch whose unit took no part.
      ReshardAfterBackward(*unit);
      if (handle->training_state() == HandleTrainingState::kBackwardPost) {
        scheduler_->Move(*handle, HandleTrainingState::kBackwardPost, HandleTrainingState::kIdle);
      }
    }
    // A unit without parameters of its own has no post hook to end it.
    unit->backward_span_.End();
    unit->pre_backward_done_ = false;
    unit->gradients_ready_ = 0;
    unit->input_gradients_pending_ = 0;  // An input whose gradient was not needed.
  }
  try {
    scheduler_->WaitForReductions();  // After the loop: it may have issued some.
  } catch (...) {
    // Every unit is idle and resharded; the next backward must queue its
    // own callback.
    backward_callback_queued_ = false;
    SetModelState(ModelTrainingState::kIdle);
    WaitForShardHold();  // A caller may catch this and step all the same.
    throw;
  }
  backward_callback_queued_ = false;
  SetModelState(ModelTrainingState::kIdle);
  ++backward_passes_;
  // The optimizer steps the shards next.
  WaitForShardHold();
  if (options_.verify_collectives_every > 0 &&
      backward_passes_ % options_.verify_collectives_every == 0) {
    group().VerifyConsistency();
    if (groups_.replicate != nullptr) groups_.replicate->VerifyConsistency();
    if (groups_.post_forward != nullptr) groups_.post_forward->VerifyConsistency();
  }
}

void FullyShardedModel::SetModelState(ModelTrainingState to) {
  if (to != training_state_ && options_.debug_log) {
    options_.debug_log(absl::StrCat("model: ", ModelTrainingStateName(training_state_), " -> ",
                                    ModelTrainingStateName(to)));
  }
  training_state_ = to;
}

int FullyShardedModel::IndexOf(const FsdpUnit& unit) const {
  for (size_t i = 0; i < units_.size(); ++i) {
    if (units_[i].get() == &unit) return static_cast<int>(i);
  }
  return -1;
}

void FullyShardedModel::Prefetch(const std::vector<int>& unit_indices) {
  for (int unit_index : unit_indices) {
    FlatParamHandle* handle = units_[unit_index]->handle_.get();
    // Only a unit that is idle (not yet run in this pass) and resharded.
    if (handle == nullptr || handle->training_state() != HandleTrainingState::kIdle) continue;
    scheduler_->Prefetch(*handle, UnshardPhase(*handle));
  }
}

void FullyShardedModel::RecordExecutionOrder() {
  order_recorded_ = true;
  if (options_.check_execution_order) {
    std::vector<std::string> names;
    for (const auto& unit : units_) names.push_back(UnitName(unit->fqn_));
    CheckSameExecutionOrderOnEveryRank(group(), post_forward_order_, names);
  }
  // Forward: the unit that entered forward next. Backward runs units in the
  // reverse of the order their forwards ended, so a unit's backward is
  // followed by that of the unit whose forward ended just before its own.
  // In forward, a unit that runs more than once keeps its first successor;
  // in backward, the unit whose forward ended last before its own (as
  // before explicit lists).
  std::vector<bool> forward_set(units_.size(), false);
  for (size_t i = 0; i + 1 < pre_forward_order_.size(); ++i) {
    const int index = pre_forward_order_[i];
    FsdpUnit& unit = *units_[index];
    if (unit.forward_prefetch_explicit_ || forward_set[index]) continue;
    unit.forward_prefetch_ = {pre_forward_order_[i + 1]};
    forward_set[index] = true;
  }
  for (size_t i = 1; i < post_forward_order_.size(); ++i) {
    const int index = post_forward_order_[i];
    FsdpUnit& unit = *units_[index];
    if (unit.backward_prefetch_explicit_) continue;
    unit.backward_prefetch_ = {post_forward_order_[i - 1]};
  }
}

std::optional<at::ScalarType> FullyShardedModel::BufferFullPrecisionDtype(
    const at::Tensor& buffer) const {
  auto it = buffer_full_dtypes_.find(buffer.unsafeGetTensorImpl());
  if (it == buffer_full_dtypes_.end()) return std::nullopt;
  return it->second;
}

absl::Status FullyShardedModel::RegisterCommHook(std::shared_ptr<CommHook> hook) {
  const std::string who = absl::StrCat("rank ", group().rank(), " of ", group().world_size(),
                                       ": RegisterCommHook: ");
  if (hook == nullptr) return absl::InvalidArgumentError(who + "the hook is null");
  // Under a hybrid root every unit's gradients cross the replicate group,
  // whatever the unit's own strategy.
  for (const auto& unit : units_) {
    const ShardingStrategy strategy =
        groups_.replicate != nullptr ? options_.strategy : unit->strategy();
    if (IsHybrid(strategy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "unit '", UnitName(unit->fqn_), "' uses ", ShardingStrategyName(strategy),
          "; communication hooks are not supported with hybrid sharding (as in PyTorch)"));
    }
    if (unit->options().reduce_quantization != CommQuantization::kNone) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "unit '", UnitName(unit->fqn_), "' has reduce_quantization; a hook replaces it"));
    }
  }
  if (comm_hook_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, "hook '", comm_hook_->Name(), "' is already registered"));
  }
  if (forward_ran_) {
    return absl::FailedPreconditionError(
        who + "register the hook before the first forward, as PyTorch requires");
  }
  comm_hook_ = std::move(hook);
  for (const auto& unit : units_) {
    if (unit->handle_) unit->handle_->SetCommHook(comm_hook_.get());
  }
  return absl::OkStatus();
}

}  // namespace fsdp
