#include "fsdp/unit_init.h"

#include <algorithm>
#include <set>
#include <vector>

#include "ATen/Functions.h"
#include "ATen/native/Resize.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "c10/core/GradMode.h"

namespace fsdp {
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
void BroadcastFromRankZero(const at::Tensor& t, const ProcessGroups& groups) {
  groups.shard->Broadcast(t, /*root=*/0)->Wait();
  if (groups.replicate != nullptr) groups.replicate->Broadcast(t, /*root=*/0)->Wait();
}

// One unit's parameters as one flat broadcast, so that the extra memory is
// one unit's.
void SyncUnitParams(const PlannedUnit& unit, const ProcessGroups& groups) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (const at::Tensor& p : unit.params) parts.push_back(p.detach().reshape({-1}));
  at::Tensor flat = at::cat(parts);
  BroadcastFromRankZero(flat, groups);
  int64_t offset = 0;
  for (const at::Tensor& p : unit.params) {
    p.detach().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

// Buffers outside ignored modules. Non-floating buffers travel as float64
// (the collectives carry floating types; integers up to 2^53 are exact).
void SyncBuffers(torch::nn::Module& root, const FsdpOptions& options,
                 const ProcessGroups& groups) {
  at::NoGradGuard no_grad;
  const std::set<const c10::TensorImpl*> ignored = IgnoredBuffers(options);
  for (const at::Tensor& buffer : root.buffers()) {
    if (!buffer.defined() || ignored.count(buffer.unsafeGetTensorImpl()) != 0) continue;
    if (buffer.is_floating_point() && buffer.is_contiguous()) {
      BroadcastFromRankZero(buffer, groups);
    } else {
      at::Tensor wire = buffer.to(at::kDouble).contiguous();
      BroadcastFromRankZero(wire, groups);
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
    const std::optional<at::ScalarType> dtype =
        plan.units[plan.OwnerOf({item.key()})].mixed_precision.buffer_dtype;
    if (!dtype || *dtype == buffer.scalar_type()) continue;
    original.emplace(buffer.unsafeGetTensorImpl(), buffer.scalar_type());
    buffer.set_data(buffer.to(*dtype));
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
                             const ModulesByName& modules,
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

}  // namespace

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

absl::Status InitUnitParams(const PlannedUnit& unit, const ModulesByName& modules,
                            const FsdpOptions& options, const ProcessGroups& groups) {
  try {
    FSDP_RETURN_IF_ERROR(MaterializeUnit(unit, modules, options));
    if (options.device_id) MoveToDevice(unit.params, *options.device_id);
    if (options.sync_module_states) {
      CollectiveLabel label(*groups.shard, groups.replicate, UnitName(unit.fqn),
                            "sync_module_states");
      SyncUnitParams(unit, groups);
    }
  } catch (...) {
    const absl::Status failed = StatusFromCurrentException();
    return absl::Status(failed.code(), absl::StrCat("unit '", UnitName(unit.fqn),
                                                    "': initializing its parameters failed: ",
                                                    failed.message()));
  }
  return absl::OkStatus();
}

absl::Status InitBuffers(torch::nn::Module& root, const ModulesByName& modules,
                         const WrapPlan& plan, const FsdpOptions& options,
                         const ProcessGroups& groups,
                         std::map<const c10::TensorImpl*, at::ScalarType>& original_dtypes) {
  try {
    // Buffers of modules without parameters of their own can still be
    // deferred.
    for (const auto& [fqn, module] : modules) {
      bool deferred = false;
      for (const at::Tensor& b : module->buffers(/*recurse=*/false)) {
        if (!IsDeferred(b)) continue;
        if (!options.param_init_fn) {
          return absl::InvalidArgumentError(
              absl::StrCat("a buffer of module '", UnitName(fqn),
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
      for (const at::Tensor& b : root.buffers()) {
        if (ignored.count(b.unsafeGetTensorImpl()) == 0) buffers.push_back(b);
      }
      MoveToDevice(buffers, *options.device_id);
    }
    if (options.sync_module_states) {
      CollectiveLabel label(*groups.shard, groups.replicate, "buffers", "sync_module_states");
      SyncBuffers(root, options, groups);
    }
    CastBuffers(root, plan, options, original_dtypes);
  } catch (...) {
    const absl::Status failed = StatusFromCurrentException();
    return absl::Status(failed.code(),
                        absl::StrCat("initializing buffers failed: ", failed.message()));
  }
  return absl::OkStatus();
}

}  // namespace fsdp
