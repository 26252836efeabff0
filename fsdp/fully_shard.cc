#include "fsdp/fully_shard.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "ATen/native/Resize.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/fnv1a.h"
#include "base/status.h"
#include "c10/core/GradMode.h"
#include "c10/core/StreamGuard.h"
#include "c10/util/Exception.h"
#include "torch/csrc/autograd/engine.h"
#include "torch/csrc/autograd/function.h"
#include "torch/csrc/autograd/function_hook.h"
#include "torch/csrc/autograd/variable.h"

namespace fsdp {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<const torch::nn::Module*, FsdpUnit*>& Registry() {
  static auto* registry = new std::unordered_map<const torch::nn::Module*, FsdpUnit*>();
  return *registry;
}

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

uint64_t NextModelId() {
  static std::atomic<uint64_t> next{1};
  return next++;
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

namespace {

// The buffers of ignored modules: neither synced nor cast.
std::set<const c10::TensorImpl*> IgnoredBuffers(const FsdpOptions& options) {
  std::set<const c10::TensorImpl*> ignored;
  for (const torch::nn::Module* module : options.ignored_modules) {
    for (const at::Tensor& b : module->buffers()) ignored.insert(b.unsafeGetTensorImpl());
  }
  return ignored;
}

// For sync_module_states: rank 0's values of `t` on every rank; under
// hybrid sharding over the shard group, then the replicate group.
void BroadcastFromRankZero(const at::Tensor& t, const FsdpOptions& options, Collectives& group) {
  group.Broadcast(t, /*root=*/0)->Wait();
  if (options.replicate_group != nullptr) {
    options.replicate_group->Broadcast(t, /*root=*/0)->Wait();
  }
}

// One unit's parameters as one flat broadcast, so that the extra memory is
// one unit's.
void SyncUnitParams(const PlannedUnit& unit, const FsdpOptions& options, Collectives& group) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (const at::Tensor& p : unit.params) parts.push_back(p.detach().reshape({-1}));
  at::Tensor flat = at::cat(parts);
  BroadcastFromRankZero(flat, options, group);
  int64_t offset = 0;
  for (const at::Tensor& p : unit.params) {
    p.detach().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

// Buffers outside ignored modules. Non-floating buffers travel as float64
// (the collectives carry floating types; integers up to 2^53 are exact).
void SyncBuffers(torch::nn::Module& root, const FsdpOptions& options, Collectives& group) {
  at::NoGradGuard no_grad;
  const std::set<const c10::TensorImpl*> ignored = IgnoredBuffers(options);
  for (const at::Tensor& buffer : root.buffers()) {
    if (!buffer.defined() || ignored.count(buffer.unsafeGetTensorImpl()) != 0) continue;
    if (buffer.is_floating_point() && buffer.is_contiguous()) {
      BroadcastFromRankZero(buffer, options, group);
    } else {
      at::Tensor wire = buffer.to(at::kDouble).contiguous();
      BroadcastFromRankZero(wire, options, group);
      buffer.copy_(wire);
    }
  }
}

// The module that directly holds the parameter named `param_fqn`.
std::string OwnerFqn(const std::string& param_fqn) {
  const size_t dot = param_fqn.rfind('.');
  return dot == std::string::npos ? "" : param_fqn.substr(0, dot);
}

// buffer_dtype: each floating buffer outside ignored modules takes the
// buffer_dtype of the unit that owns its module (the deepest unit whose FQN
// prefixes it); its original dtype is remembered for FULL state dicts.
void CastBuffers(torch::nn::Module& root, const WrapPlan& plan, const FsdpOptions& options,
                 std::map<const c10::TensorImpl*, at::ScalarType>& original) {
  const std::set<const c10::TensorImpl*> ignored = IgnoredBuffers(options);
  at::NoGradGuard no_grad;
  for (const auto& item : root.named_buffers()) {
    const at::Tensor& buffer = item.value();
    if (!buffer.defined() || !buffer.is_floating_point() ||
        ignored.count(buffer.unsafeGetTensorImpl()) != 0) {
      continue;
    }
    const std::optional<DType> dtype =
        plan.units[plan.OwnerOf({item.key()})].mixed_precision.buffer_dtype;
    if (!dtype || ToScalarType(*dtype) == buffer.scalar_type()) continue;
    original.emplace(buffer.unsafeGetTensorImpl(), buffer.scalar_type());
    buffer.set_data(buffer.to(ToScalarType(*dtype)));
  }
}

bool IsDeferred(const at::Tensor& t) {
  return t.defined() && !t.is_meta() && t.numel() > 0 && t.storage().nbytes() == 0;
}

void AllocateDeferred(const at::Tensor& t) {
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(),
                               (t.storage_offset() + t.numel()) * t.element_size());
}

// Allocates the unit's deferred parameters (DeferParameterAllocation), with
// the deferred buffers of their modules, and calls param_init_fn once on
// each of those modules to fill them.
absl::Status MaterializeUnit(const PlannedUnit& unit,
                             const std::map<std::string, torch::nn::Module*>& modules,
                             const FsdpOptions& options) {
  at::NoGradGuard no_grad;
  std::vector<std::string> owners;
  for (size_t i = 0; i < unit.params.size(); ++i) {
    const at::Tensor& p = unit.params[i];
    if (p.is_meta()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", unit.param_fqns[i],
          "' is on the meta device, which libtorch 1.13 cannot move to CPU in place; build "
          "the model on CPU and release its memory with fsdp::DeferParameterAllocation "
          "instead"));
    }
    if (!IsDeferred(p)) continue;
    if (!options.param_init_fn) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", unit.param_fqns[i],
          "' is deferred (DeferParameterAllocation); set FsdpOptions::param_init_fn to "
          "initialize it"));
    }
    AllocateDeferred(p);
    const std::string owner = OwnerFqn(unit.param_fqns[i]);
    if (std::find(owners.begin(), owners.end(), owner) == owners.end()) owners.push_back(owner);
  }
  for (const std::string& owner : owners) {
    auto it = modules.find(owner);
    if (it == modules.end()) {
      return absl::InternalError(absl::StrCat("no module '", owner, "' holds its parameters"));
    }
    for (const at::Tensor& b : it->second->buffers(/*recurse=*/false)) {
      if (IsDeferred(b)) AllocateDeferred(b);
    }
    options.param_init_fn(*it->second);
  }
  return absl::OkStatus();
}

// device_id: `tensors` move to `device` in place of their data.
void MoveToDevice(const std::vector<at::Tensor>& tensors, const c10::Device& device) {
  at::NoGradGuard no_grad;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.device() != device) t.set_data(t.to(device));
  }
}

// device_id must name one concrete device, and parameters already on an
// accelerator must be on it (they are not moved between accelerators).
absl::Status CheckDeviceId(const FsdpOptions& options, const WrapPlan& plan) {
  if (!options.device_id) return absl::OkStatus();
  const c10::Device& device = *options.device_id;
  if (device.is_meta() || (!device.is_cpu() && !device.has_index())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FsdpOptions::device_id must name a device with its index (e.g. cuda:0), got '",
        device.str(), "'"));
  }
  for (const PlannedUnit& unit : plan.units) {
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const c10::Device on = unit.params[i].device();
      if (!on.is_cpu() && on != device) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", unit.param_fqns[i], "' is on ", on.str(),
            " but FsdpOptions::device_id is ", device.str(),
            "; build the model on the host or on that device"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

void DeferParameterAllocation(torch::nn::Module& module) {
  for (const at::Tensor& t : module.parameters()) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "DeferParameterAllocation: ",
                "parameters must be contiguous CPU tensors");
    at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
  }
  for (const at::Tensor& t : module.buffers()) {
    if (t.defined() && t.device().is_cpu() && t.is_contiguous()) {
      at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
    }
  }
}

absl::Status FullyShardedModel::RequireIdle(const std::string& what) const {
  if (training_state_ != ModelTrainingState::kIdle) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " on rank ", group_.rank(),
                     ": the model is in forward or backward; call it between steps"));
  }
  for (const auto& unit : units_) {
    if (unit->handle_ != nullptr &&
        unit->handle_->training_state() != HandleTrainingState::kIdle) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " on rank ", group_.rank(), ": unit '", UnitName(unit->fqn_),
          "' is in state ", HandleTrainingStateName(unit->handle_->training_state()),
          " (inside SummonFullParams?)"));
    }
  }
  return absl::OkStatus();
}

const char* ModelTrainingStateName(ModelTrainingState state) {
  return state == ModelTrainingState::kIdle ? "IDLE" : "FORWARD_BACKWARD";
}

FsdpUnit* GetModuleUnit(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(module);
  return it == Registry().end() ? nullptr : it->second;
}

FullyShardedModel::FullyShardedModel(std::shared_ptr<torch::nn::Module> root,
                                     Collectives& group, const FsdpOptions& options)
    : root_(std::move(root)),
      group_(group),
      options_(options),
      id_(NextModelId()) {}

FullyShardedModel::~FullyShardedModel() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (auto& unit : units_) {
    Registry().erase(unit->module_);
    for (auto& [node, key] : unit->accumulators_) node->del_post_hook(key);
  }
}

absl::StatusOr<std::unique_ptr<FullyShardedModel>> FullyShardedModel::Wrap(
    std::shared_ptr<torch::nn::Module> root, Collectives& group, const FsdpOptions& options,
    const UnitSelector& select) {
  return Wrap(std::move(root), group, options, LambdaPolicy(select, {}, "selector"));
}

absl::StatusOr<std::unique_ptr<FullyShardedModel>> FullyShardedModel::Wrap(
    std::shared_ptr<torch::nn::Module> root, Collectives& group, const FsdpOptions& options,
    const WrapPolicy& policy) {
  if (!root) return absl::InvalidArgumentError("FullyShardedModel::Wrap: root is null");
  const std::string who = absl::StrCat("rank ", group.rank(), " of ", group.world_size(), ": ");
  if (IsHybrid(options.strategy) != (options.replicate_group != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, "FsdpOptions::replicate_group is ",
        options.replicate_group != nullptr ? "set" : "not set", " but the strategy is ",
        ShardingStrategyName(options.strategy),
        ": hybrid sharding (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) takes the shard group as the "
        "group and the replicate group in replicate_group; the other strategies take no "
        "replicate group"));
  }
  if (options.verify_collectives_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, "FsdpOptions::verify_collectives_every must be >= 0 (0: never), got ",
                     options.verify_collectives_every));
  }
  absl::StatusOr<WrapPlan> plan = PlanWrap(*root, group.world_size(), options, policy);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(), absl::StrCat(who, plan.status().message()));
  }
  if (absl::Status device_ok = CheckDeviceId(options, *plan); !device_ok.ok()) {
    return absl::Status(device_ok.code(), absl::StrCat(who, device_ok.message()));
  }
  std::unique_ptr<FullyShardedModel> model(new FullyShardedModel(root, group, options));
  // Every unit's parameters are checked before any handle swaps them to
  // shards: a failed Wrap leaves the model as it was.
  std::vector<std::vector<FlatParamEntry>> entries;
  for (const PlannedUnit& planned : plan->units) {
    entries.emplace_back();
    for (size_t i = 0; i < planned.params.size(); ++i) {
      entries.back().push_back({planned.param_fqns[i], planned.params[i]});
    }
    if (entries.back().empty()) continue;
    FSDP_RETURN_IF_ERROR(
        FlatParamHandle::CheckParams(UnitName(planned.fqn),
                                     entries.back(), group));
  }
  // Deferred parameters get memory and values unit by unit, just before
  // their handle shards them.
  c10::Device device(c10::DeviceType::CPU);
  for (const auto& unit_entries : entries) {
    if (!unit_entries.empty()) device = unit_entries.front().param.device();
  }
  if (options.device_id) device = *options.device_id;
  std::map<std::string, torch::nn::Module*> modules;
  for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    modules[item.key()] = item.value().get();
  }
  try {
    model->scheduler_ = std::make_unique<UnitScheduler>(group, model->options_, device);
  } catch (...) {
    const absl::Status failed = StatusFromCurrentException();
    return absl::Status(failed.code(), absl::StrCat(who, "cannot compute on ", device.str(),
                                                    ": ", failed.message()));
  }
  for (size_t u = 0; u < plan->units.size(); ++u) {
    const PlannedUnit& planned = plan->units[u];
    auto unit = std::make_unique<FsdpUnit>();
    unit->fqn_ = planned.fqn;
    unit->module_ = planned.module;
    unit->is_root_ = u == 0;
    unit->strategy_ = planned.strategy;
    unit->mixed_precision_ = planned.mixed_precision;
    unit->model_ = model.get();
    if (!entries[u].empty()) {
      // One unit at a time: materialize, take rank 0's values, shard. No
      // rank ever holds more than one unit's full parameters beyond what
      // the model held before Wrap.
      try {
        FSDP_RETURN_IF_ERROR(MaterializeUnit(planned, modules, options));
        if (options.device_id) MoveToDevice(planned.params, *options.device_id);
        if (options.sync_module_states) {
          CollectiveLabel label(group, options.replicate_group, UnitName(planned.fqn),
                                "sync_module_states");
          SyncUnitParams(planned, options, group);
        }
      } catch (...) {
        const absl::Status failed = StatusFromCurrentException();
        return absl::Status(failed.code(),
                            absl::StrCat(who, "unit '", UnitName(planned.fqn),
                                         "': initializing its parameters failed: ",
                                         failed.message()));
      }
      FlatParamHandleOptions handle_options;
      handle_options.strategy = planned.strategy;
      handle_options.replicate_group = options.replicate_group;
      const MixedPrecision& mp = planned.mixed_precision;
      if (mp.param_dtype) handle_options.param_dtype = ToScalarType(*mp.param_dtype);
      // PyTorch's default: reduce in param_dtype when only that is set.
      if (mp.reduce_dtype || mp.param_dtype) {
        handle_options.reduce_dtype = ToScalarType(mp.reduce_dtype ? *mp.reduce_dtype
                                                                   : *mp.param_dtype);
      }
      handle_options.keep_low_precision_grads = mp.keep_low_precision_grads;
      handle_options.offload_params = options.offload_params;
      auto handle = FlatParamHandle::Create(UnitName(planned.fqn),
                                            std::move(entries[u]), group, handle_options);
      if (!handle.ok()) return handle.status();
      unit->handle_ = std::move(*handle);
    }
    model->units_.push_back(std::move(unit));
  }
  try {
    // Buffers of modules without parameters of their own can still be on
    // the meta device.
    for (const auto& [fqn, module] : modules) {
      bool deferred = false;
      for (const at::Tensor& b : module->buffers(/*recurse=*/false)) {
        if (!IsDeferred(b)) continue;
        if (!options.param_init_fn) {
          return absl::InvalidArgumentError(absl::StrCat(
              who, "a buffer of module '", UnitName(fqn),
              "' is deferred; set FsdpOptions::param_init_fn to initialize it"));
        }
        AllocateDeferred(b);
        deferred = true;
      }
      if (deferred) {
        at::NoGradGuard no_grad;
        options.param_init_fn(*module);
      }
    }
    if (options.device_id) {
      const std::set<const c10::TensorImpl*> ignored = IgnoredBuffers(options);
      std::vector<at::Tensor> buffers;
      for (const at::Tensor& b : root->buffers()) {
        if (ignored.count(b.unsafeGetTensorImpl()) == 0) buffers.push_back(b);
      }
      MoveToDevice(buffers, *options.device_id);
    }
    if (options.sync_module_states) {
      CollectiveLabel label(group, options.replicate_group, "buffers", "sync_module_states");
      SyncBuffers(*root, options, group);
    }
    CastBuffers(*root, *plan, options, model->buffer_full_dtypes_);
  } catch (...) {
    const absl::Status failed = StatusFromCurrentException();
    return absl::Status(failed.code(),
                        absl::StrCat(who, "initializing buffers failed: ", failed.message()));
  }
  for (PlannedUnit& planned : plan->units) planned.params.clear();  // No extra references.
  model->plan_ = std::move(*plan);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (const auto& unit : model->units_) {
    if (Registry().count(unit->module_) != 0) {
      return absl::AlreadyExistsError(absl::StrCat(
          who, "module '", UnitName(unit->fqn_),
          "' was wrapped by another model while this one was being wrapped"));
    }
  }
  for (const auto& unit : model->units_) Registry()[unit->module_] = unit.get();
  return model;
}

std::string FullyShardedModel::Describe(const FsdpUnit& unit) const {
  return absl::StrCat("unit '", UnitName(unit.fqn_), "' on rank ",
                      group_.rank(), " of ", group_.world_size());
}

int64_t FullyShardedModel::FullParamBytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) {
    if (unit->handle_) bytes += unit->handle_->full_param_bytes();
  }
  return bytes;
}

void FullyShardedModel::LazyInit() {
  // Ranks that wrapped different models, or the same model with different
  // units, options or world sizes, would pair collectives of different units
  // and hang or exchange wrong shards. One all-gather of a fingerprint of
  // the wrap plan per rank catches that before the first collective of
  // training.
  uint64_t hash = Fnv1aString(kFnv1aOffsetBasis, CrossRankOptionsKey(options_));
  int64_t elements = 0;
  for (const auto& unit : units_) {
    const int64_t numel = unit->handle_ ? unit->handle_->flat_numel() : 0;
    elements += numel;
    hash = Fnv1aString(hash, absl::StrCat(unit->fqn_, ":", numel, ":",
                                          static_cast<int>(unit->strategy_), ":",
                                          unit->mixed_precision_.ToString(), ";"));
  }
  const int world = group_.world_size();
  CollectiveLabel label(group_, "", "lazy init (wrap plan check)");
  at::Tensor mine = at::tensor({static_cast<double>(units_.size()), static_cast<double>(elements),
                                static_cast<double>(hash >> 12)},
                               at::kDouble);
  at::Tensor all = at::empty({world * 3}, at::kDouble);
  group_.AllGatherIntoTensor(all, mine)->Wait();
  at::Tensor table = all.view({world, 3});
  if (at::equal(table, table[0].expand({world, 3}))) {
    initialized_ = true;
    return;
  }
  std::string ranks;
  for (int r = 0; r < world; ++r) {
    absl::StrAppend(&ranks, r == 0 ? "" : "; ", "rank ", r, ": ",
                    static_cast<int64_t>(table[r][0].item<double>()), " units, ",
                    static_cast<int64_t>(table[r][1].item<double>()),
                    " parameter elements, plan fingerprint ",
                    static_cast<int64_t>(table[r][2].item<double>()));
  }
  TORCH_CHECK(false, "rank ", group_.rank(), " of ", world,
              ": ranks wrapped the model differently (units, their parameters, or FSDP "
              "options differ) — ", ranks,
              ". Every rank must wrap the same model with the same policy and options.");
}

void FullyShardedModel::PreForward(FsdpUnit& unit) {
  if (!initialized_) LazyInit();
  if (options_.trace != nullptr) unit.forward_begin_us_ = options_.trace->NowUs();
  FlatParamHandle* handle = unit.handle_.get();
  if (handle == nullptr) {
    SetModelState(ModelTrainingState::kForwardBackward);
    if (!order_recorded_) pre_forward_order_.push_back(IndexOf(unit));
    return;
  }
  scheduler_->Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kForward);
  SetModelState(ModelTrainingState::kForwardBackward);  // Only once admitted.
  if (!order_recorded_) pre_forward_order_.push_back(IndexOf(unit));
  scheduler_->Unshard(*handle, UnshardPhase(*handle));
  if (options_.forward_prefetch) Prefetch(unit.forward_prefetch_);
  HookGradientAccumulators(unit);
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
  for (const FlatParamEntry& entry : entries) {
    if (!entry.param.requires_grad()) continue;
    FsdpUnit::AccumulatorPtr node = torch::autograd::impl::grad_accumulator(entry.param);
    FsdpUnit* u = &unit;
    const uintptr_t key = node->add_post_hook(
        std::make_unique<AccumulatorPostHook>([this, u] { PostBackward(*u); }));
    unit.accumulators_.emplace_back(std::move(node), key);
  }
}

void FullyShardedModel::PostForward(FsdpUnit& unit, const std::vector<at::Tensor>& outputs) {
  if (options_.trace != nullptr) {
    options_.trace->AddSpan("forward", UnitName(unit.fqn_), unit.forward_begin_us_, options_.trace->NowUs());
  }
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
    const bool reshard = !backward_follows ||
                         (ReshardsAfterForward(unit.strategy_) && !unit.is_root_);
    if (reshard) scheduler_->Reshard(*handle);
  }
  if (!backward_follows) {
    if (unit.is_root_) {
      for (auto& u : units_) {
        if (u->handle_) scheduler_->DiscardPrefetch(*u->handle_);
      }
      SetModelState(ModelTrainingState::kIdle);
    }
    return;
  }
  FsdpUnit* u = &unit;
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([this, u](const at::Tensor& grad) {
      PreBackward(*u);
      return grad;
    });
  }
}

void FullyShardedModel::PreBackward(FsdpUnit& unit) {
  if (unit.pre_backward_done_) return;
  unit.pre_backward_done_ = true;
  if (options_.trace != nullptr) unit.backward_begin_us_ = options_.trace->NowUs();
  if (!backward_callback_queued_) {
    backward_callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { FinishBackward(); });
  }
  FlatParamHandle* handle = unit.handle_.get();
  if (handle == nullptr) return;
  scheduler_->Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kBackwardPre);
  scheduler_->Unshard(*handle, UnshardPhase(*handle));
  handle->PrepareGradientsForBackward();
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPre) {
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
  ReduceOrKeep(*handle);
  scheduler_->Reshard(*handle);
  if (options_.trace != nullptr) {
    options_.trace->AddSpan("backward", UnitName(unit.fqn_), unit.backward_begin_us_,
                            options_.trace->NowUs());
  }
  if (options_.backward_prefetch == BackwardPrefetch::kBackwardPost) {
    Prefetch(unit.backward_prefetch_);
  }
}

void FullyShardedModel::ReduceOrKeep(FlatParamHandle& handle) {
  if (!handle.requires_grad()) return;  // A frozen unit has no gradients.
  if (no_sync_) {
    handle.KeepGradientsUnreduced();
    return;
  }
  scheduler_->ReduceGradients(handle);
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
        ReduceOrKeep(*handle);
        if (options_.trace != nullptr) {
          options_.trace->AddSpan("backward", UnitName(unit->fqn_), unit->backward_begin_us_,
                                  options_.trace->NowUs());
        }
      }
      scheduler_->DiscardPrefetch(*handle);  // A prefetch whose unit took no part.
      scheduler_->Reshard(*handle);
      if (handle->training_state() == HandleTrainingState::kBackwardPost) {
        scheduler_->Move(*handle, HandleTrainingState::kBackwardPost, HandleTrainingState::kIdle);
      }
    }
    unit->pre_backward_done_ = false;
    unit->gradients_ready_ = 0;
  }
  scheduler_->WaitForReductions();  // After the loop: it may have issued some.
  backward_callback_queued_ = false;
  SetModelState(ModelTrainingState::kIdle);
  ++backward_passes_;
  if (options_.verify_collectives_every > 0 &&
      backward_passes_ % options_.verify_collectives_every == 0) {
    group_.VerifyConsistency();
    if (options_.replicate_group != nullptr) options_.replicate_group->VerifyConsistency();
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

void FullyShardedModel::Prefetch(int unit_index) {
  if (unit_index < 0) return;
  FlatParamHandle* handle = units_[unit_index]->handle_.get();
  // Only a unit that is idle (not yet run in this pass) and resharded.
  if (handle == nullptr || handle->training_state() != HandleTrainingState::kIdle) return;
  scheduler_->IssueUnshard(*handle, UnshardPhase(*handle));
}

void FullyShardedModel::RecordExecutionOrder() {
  order_recorded_ = true;
  if (options_.check_execution_order) CheckExecutionOrderAcrossRanks(post_forward_order_);
  // Forward: the unit that entered forward next. Backward runs units in the
  // reverse of the order their forwards ended, so a unit's backward is
  // followed by that of the unit whose forward ended just before its own.
  for (size_t i = 0; i + 1 < pre_forward_order_.size(); ++i) {
    FsdpUnit& unit = *units_[pre_forward_order_[i]];
    if (unit.forward_prefetch_ < 0) unit.forward_prefetch_ = pre_forward_order_[i + 1];
  }
  for (size_t i = 1; i < post_forward_order_.size(); ++i) {
    units_[post_forward_order_[i]]->backward_prefetch_ = post_forward_order_[i - 1];
  }
}

void FullyShardedModel::CheckExecutionOrderAcrossRanks(const std::vector<int>& order) {
  const int world = group_.world_size();
  CollectiveLabel label(group_, "", "execution order check");
  const std::string mine(reinterpret_cast<const char*>(order.data()), order.size() * sizeof(int));
  std::vector<std::vector<int>> orders;
  size_t longest = 0;
  for (const std::string& bytes : AllGatherBytes(group_, mine)) {
    orders.emplace_back(bytes.size() / sizeof(int));
    std::memcpy(orders.back().data(), bytes.data(), orders.back().size() * sizeof(int));
    longest = std::max(longest, orders.back().size());
  }
  // The unit index rank r ran at `pos`; -1 once its forward was over.
  auto ran = [&orders](int r, size_t pos) { return pos < orders[r].size() ? orders[r][pos] : -1; };
  for (size_t pos = 0; pos < longest; ++pos) {
    bool same = true;
    for (int r = 1; r < world; ++r) same = same && ran(r, pos) == ran(0, pos);
    if (same) continue;
    std::string ranks;
    for (int r = 0; r < world; ++r) {
      const int index = ran(r, pos);
      absl::StrAppend(&ranks, r == 0 ? "" : ", ", "rank ", r, " ",
                      index < 0 ? std::string("had finished its forward")
                                : absl::StrCat("ran '", UnitName(units_[index]->fqn_), "'"));
    }
    TORCH_CHECK(false, "rank ", group_.rank(), " of ", world,
                ": FSDP units ran in different orders on different ranks in the first "
                "forward; at position ", pos + 1, " of the order in which units finished "
                "their forward, ", ranks, ". Every rank must run the same units in the "
                "same order.");
  }
}

at::Tensor FullyShardedModel::ClipGradNorm(double max_norm, double norm_type) {
  ThrowIfError(RequireIdle("ClipGradNorm"));
  TORCH_CHECK(norm_type >= 1.0, "ClipGradNorm: norm_type ", norm_type,
              " must be >= 1 or infinity");
  TORCH_CHECK(max_norm >= 0, "ClipGradNorm: max_norm ", max_norm, " must be >= 0");
  const bool infinity = std::isinf(norm_type);
  // Sharded units' gradients partition the unsharded ones across ranks;
  // NO_SHARD units' gradients are whole (and equal) on every rank.
  std::vector<at::Tensor> grads;
  at::Tensor sharded = at::zeros({1}, at::kDouble);
  at::Tensor replicated = at::zeros({1}, at::kDouble);
  bool any_sharded = false;  // The same on every rank (the plan is).
  for (const auto& unit : units_) {
    if (!unit->handle_) continue;
    TORCH_CHECK(!unit->handle_->holds_unreduced_gradients(), Describe(*unit),
                ": ClipGradNorm inside NoSync (gradients are not reduced yet)");
    const bool is_sharded = unit->strategy_ != ShardingStrategy::kNoShard;
    any_sharded = any_sharded || is_sharded;
    at::Tensor& part = is_sharded ? sharded : replicated;
    // Summed where the unit's gradients are (the compute device, or the
    // host when offloading), then moved to the host once per unit.
    at::Tensor unit_part;
    for (const FlatParamEntry& entry : unit->handle_->entries()) {
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
  if (any_sharded && group_.world_size() > 1) {
    CollectiveLabel label(group_, "", "clip_grad_norm");
    if (infinity) {
      at::Tensor all = at::empty({group_.world_size()}, at::kDouble);
      group_.AllGatherIntoTensor(all, sharded)->Wait();
      sharded = all.max().view({1});
    } else {
      group_.AllReduce(sharded, ReduceOp::kSum)->Wait();
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

SummonFullParams::SummonFullParams(FullyShardedModel& model, const SummonOptions& options)
    : model_(model), options_(options), rank_(model.group().rank()) {
  TORCH_CHECK(!(options.writeback && options.rank0_only), "SummonFullParams on rank ", rank_,
              ": writeback and rank0_only together are not supported (the other ranks' "
              "shards would not see rank 0's changes)");
  ThrowIfError(model.RequireIdle("SummonFullParams"));
  for (const auto& unit : model.units()) {
    if (!options.recurse && !unit->is_root()) continue;
    if (unit->handle() != nullptr) handles_.push_back(unit->handle());
  }
  UnitScheduler& scheduler = model.scheduler();
  for (FlatParamHandle* handle : handles_) {
    scheduler.Move(*handle, HandleTrainingState::kIdle, HandleTrainingState::kSummonFullParams);
    scheduler.Unshard(*handle, "summon_full_params");
    if (options.with_grads) scheduler.UnshardGradients(*handle, "summon_full_params");
    if (options.rank0_only && rank_ != 0) {
      scheduler.ReshardGradients(*handle, /*writeback=*/false);
      scheduler.Reshard(*handle);
    }
  }
}

SummonFullParams::~SummonFullParams() {
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

std::optional<at::ScalarType> FullyShardedModel::BufferFullPrecisionDtype(
    const at::Tensor& buffer) const {
  auto it = buffer_full_dtypes_.find(buffer.unsafeGetTensorImpl());
  if (it == buffer_full_dtypes_.end()) return std::nullopt;
  return it->second;
}

absl::Status FullyShardedModel::RegisterCommHook(std::shared_ptr<CommHook> hook) {
  const std::string who = absl::StrCat("rank ", group_.rank(), " of ", group_.world_size(),
                                       ": RegisterCommHook: ");
  if (hook == nullptr) return absl::InvalidArgumentError(who + "the hook is null");
  // Under a hybrid root every unit's gradients cross the replicate group,
  // whatever the unit's own strategy.
  for (const auto& unit : units_) {
    const ShardingStrategy strategy =
        options_.replicate_group != nullptr ? options_.strategy : unit->strategy_;
    if (IsHybrid(strategy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "unit '", UnitName(unit->fqn_), "' uses ", ShardingStrategyName(strategy),
          "; communication hooks are not supported with hybrid sharding (as in PyTorch)"));
    }
  }
  if (comm_hook_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, "hook '", comm_hook_->Name(), "' is already registered"));
  }
  if (initialized_) {
    return absl::FailedPreconditionError(
        who + "register the hook before the first forward, as PyTorch requires");
  }
  comm_hook_ = std::move(hook);
  for (const auto& unit : units_) {
    if (unit->handle_) unit->handle_->SetCommHook(comm_hook_.get());
  }
  return absl::OkStatus();
}

void FullyShardedModel::Apply(const std::function<void(torch::nn::Module&)>& fn) {
  SummonFullParams full(*this);
  at::NoGradGuard no_grad;
  // Children before parents, as torch::nn::Module::apply's post-order.
  const auto modules = root_->modules(/*include_self=*/true);
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) fn(**it);
}

NoSync::NoSync(FullyShardedModel& model) : model_(model), previous_(model.no_sync_) {
  ThrowIfError(model.RequireIdle("NoSync"));
  model_.no_sync_ = true;
}

NoSync::~NoSync() { model_.no_sync_ = previous_; }

UnitForward::UnitForward(const torch::nn::Module* module) : unit_(GetModuleUnit(module)) {
  if (unit_ == nullptr) return;
  try {
    unit_->model_->PreForward(*unit_);
  } catch (...) {
    // A failed all-gather: no destructor will run for this scope.
    Abandon();
    throw;
  }
}

UnitForward::~UnitForward() {
  if (unit_ == nullptr || returned_) return;
  Abandon();
}

void UnitForward::Abandon() {
  // The forward threw: leave the unit resharded and idle (and the model,
  // if this is the root).
  if (unit_->is_root_) unit_->model_->SetModelState(ModelTrainingState::kIdle);
  FlatParamHandle* handle = unit_->handle_.get();
  if (handle == nullptr) return;
  try {
    if (handle->training_state() == HandleTrainingState::kForward) {
      unit_->model_->scheduler().Move(*handle, HandleTrainingState::kForward,
                                      HandleTrainingState::kIdle);
    }
    unit_->model_->scheduler().Reshard(*handle);
  } catch (...) {
    // Destructors cannot throw; the forward's exception is the one to see.
  }
}

at::Tensor UnitForward::Input(const at::Tensor& input) const {
  if (unit_ == nullptr || !input.defined() || !input.is_floating_point()) return input;
  const MixedPrecision& mp = unit_->mixed_precision_;
  const bool cast = unit_->is_root_ ? mp.cast_root_forward_inputs : mp.cast_forward_inputs;
  if (!cast || !mp.param_dtype) return input;
  return input.to(ToScalarType(*mp.param_dtype));
}

at::Tensor UnitForward::Return(at::Tensor output) {
  if (unit_ != nullptr) unit_->model_->PostForward(*unit_, {output});
  returned_ = true;
  return output;
}

std::vector<at::Tensor> UnitForward::Return(std::vector<at::Tensor> outputs) {
  if (unit_ != nullptr) unit_->model_->PostForward(*unit_, outputs);
  returned_ = true;
  return outputs;
}

}  // namespace fsdp
