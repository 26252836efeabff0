#include "fsdp/activation_checkpointing.h"

#include <mutex>
#include <unordered_set>
#include <utility>

#include "ATen/Context.h"
#include "ATen/autocast_mode.h"
#include "ATen/core/ivalue.h"
#include "absl/strings/str_cat.h"
#include "c10/core/GradMode.h"
#include "c10/util/Exception.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/csrc/autograd/custom_function.h"
#include "torch/csrc/autograd/functions/accumulate_grad.h"
#include "torch/version.h"

namespace fsdp {
namespace {

// The region the calling thread's body runs in (null outside one).
thread_local const std::string* t_region = nullptr;

class RegionScope {
 public:
  explicit RegionScope(const std::string* name) : previous_(t_region) { t_region = name; }
  ~RegionScope() { t_region = previous_; }
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;

 private:
  const std::string* previous_;
};

// Random-number states of the generators a body may draw from.
struct RngStates {
  std::vector<at::Generator> generators;
  std::vector<at::Tensor> states;
};

at::Tensor StateOf(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetState(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

RngStates CaptureRng(const std::vector<at::Tensor>& inputs, const CheckpointOptions& options) {
  RngStates rng;
  if (!options.preserve_rng_state) return rng;
  rng.generators.push_back(at::globalContext().defaultGenerator(at::Device(at::kCPU)));
  std::vector<c10::DeviceIndex> cuda_devices;
  for (const at::Tensor& input : inputs) {
    if (!input.defined() || !input.is_cuda()) continue;
    const c10::DeviceIndex index = input.device().index();
    bool seen = false;
    for (c10::DeviceIndex d : cuda_devices) seen = seen || d == index;
    if (seen) continue;
    cuda_devices.push_back(index);
    rng.generators.push_back(at::globalContext().defaultGenerator(input.device()));
  }
  for (const at::Generator& gen : options.generators) rng.generators.push_back(gen);
  for (at::Generator& gen : rng.generators) rng.states.push_back(StateOf(gen));
  return rng;
}

// Sets the captured states for the recompute and puts the current ones
// back afterwards (PyTorch's fork_rng), so code after the backward draws
// what it would have drawn without checkpointing.
class RngFork {
 public:
  explicit RngFork(RngStates& rng) : rng_(rng) {
    for (at::Generator& gen : rng_.generators) current_.push_back(StateOf(gen));
    for (size_t i = 0; i < rng_.generators.size(); ++i)
      SetState(rng_.generators[i], rng_.states[i]);
  }
  ~RngFork() {
    for (size_t i = 0; i < rng_.generators.size(); ++i) SetState(rng_.generators[i], current_[i]);
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates& rng_;
  std::vector<at::Tensor> current_;
};

// libtorch 2.4 replaced the per-device autocast functions
// (is_cpu_enabled, ...) by ones taking the device type.
#define kPerDeviceAutocastApi \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))

// Autocast's thread-local state for CPU and CUDA, captured at forward and
// set for the recompute.
struct AutocastState {
  bool cpu_enabled = false;
  bool cuda_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  at::ScalarType cuda_dtype = at::kHalf;

  static AutocastState Current() {
    AutocastState s;
#if kPerDeviceAutocastApi
    s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
    s.cpu_enabled = at::autocast::is_cpu_enabled();
    s.cuda_enabled = at::autocast::is_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
    return s;
  }

  void Set() const {
#if kPerDeviceAutocastApi
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
#else
    at::autocast::set_cpu_enabled(cpu_enabled);
    at::autocast::set_enabled(cuda_enabled);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype);
#endif
  }
};

// Turns autocast's cast cache off. The cache keys low-precision copies of
// leaves that require grad (the parameters) by tensor and is cleared only
// when an autocast scope ends. A copy cached in a region's forward (where
// gradients are off) would have no history, and a use of the same
// parameter after the region, in the same scope, would take it and lose
// its gradient (PyTorch issue 112583; not seen with libtorch 1.13 or 2.15);
// one cached in a recompute (in backward, inside no scope) would be used,
// stale, by the forwards after the optimizer step. Uncached casts compute
// the same values.
class CastCacheOff {
 public:
  CastCacheOff() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~CastCacheOff() { at::autocast::set_autocast_cache_enabled(previous_); }
  CastCacheOff(const CastCacheOff&) = delete;
  CastCacheOff& operator=(const CastCacheOff&) = delete;

 private:
  bool previous_;
};

// Autocast as it was at forward, for the recompute, without the cast cache.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : previous_(AutocastState::Current()) {
    state.Set();
  }
  ~AutocastScope() { previous_.Set(); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  CastCacheOff no_cache_;
  AutocastState previous_;
};

// What the node keeps besides the saved inputs.
struct RegionRecord {
  std::string name;
  CheckpointBody body;
  std::vector<at::Tensor> parameters;  // Those that require grad.
  RngStates rng;
  AutocastState autocast;
};

// Refuses a recompute graph that reaches a leaf requiring grad which is
// neither an input nor a listed parameter: its gradient would be lost.
void CheckLeaves(const RegionRecord& record, const std::vector<at::Tensor>& outputs,
                 const std::vector<at::Tensor>& sources) {
  std::unordered_set<const c10::TensorImpl*> known;
  for (const at::Tensor& t : sources) known.insert(t.unsafeGetTensorImpl());
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& variable = leaf->variable;
      TORCH_CHECK(!variable.defined() || known.count(variable.unsafeGetTensorImpl()) > 0,
                  "activation checkpointing: region '", record.name,
                  "' uses a tensor that requires grad (shape ", variable.sizes(),
                  ") which is neither one of its inputs nor one of its parameters; its gradient "
                  "would be lost. Pass it as an input of the region (or, for Checkpoint, list it "
                  "among the parameters)");
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static std::vector<at::Tensor> forward(torch::autograd::AutogradContext* ctx,
                                         at::TensorList inputs, at::TensorList parameters,
                                         std::shared_ptr<RegionRecord> record) {
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> outputs;
    {
      CastCacheOff no_cache;
      RegionScope region(&record->name);
      outputs = record->body(inputs.vec());  // Gradients are off in a node's forward.
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(outputs[i].defined(), "activation checkpointing: region '", record->name,
                  "' returned an undefined tensor as output ", i,
                  "; a region returns only defined tensors");
    }
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["record"] =
        c10::IValue::make_capsule(c10::make_intrusive<RecordCapsule>(record));
    std::vector<at::Tensor> non_differentiable;
    for (at::Tensor& out : outputs) {
      if (!out.is_floating_point() && !out.is_complex()) {
        non_differentiable.push_back(out);
      }
    }
    ctx->mark_non_differentiable(non_differentiable);
    return outputs;
  }

  static std::vector<at::Tensor> backward(torch::autograd::AutogradContext* ctx,
                                          std::vector<at::Tensor> grad_outputs) {
    const std::shared_ptr<RegionRecord> record =
        c10::static_intrusive_pointer_cast<RecordCapsule>(ctx->saved_data["record"].toCapsule())
            ->record;
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    // The gradients are taken on detached copies of the inputs, so second-
    // order terms would stop there instead of reaching the real inputs.
    TORCH_CHECK(!c10::GradMode::is_enabled(), "activation checkpointing: region '", record->name,
                "' cannot be differentiated twice (backward with create_graph); run it without "
                "checkpointing");
    std::vector<at::Tensor> detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor copy = saved[i].detach();
      if (ctx->needs_input_grad(i)) copy.requires_grad_(true);
      detached.push_back(copy);
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork rng(record->rng);
      AutocastScope autocast(record->autocast);
      RegionScope region(&record->name);
      c10::AutoGradMode grad(true);
      outputs = record->body(detached);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "activation checkpointing: region '",
                record->name, "' returned ", outputs.size(), " tensors in its recompute but ",
                grad_outputs.size(),
                " in forward; its body must not depend on anything but its "
                "inputs and parameters");
    std::vector<at::Tensor> sources;
    std::vector<size_t> source_slot;  // Position among the node's inputs.
    for (size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].requires_grad()) {
        sources.push_back(detached[i]);
        source_slot.push_back(i);
      }
    }
    std::vector<at::Tensor> known = sources;
    for (size_t j = 0; j < record->parameters.size(); ++j) {
      known.push_back(record->parameters[j]);
      // Not wanted, or frozen since the forward (autograd still asks for
      // its gradient then; backward without checkpointing skips it).
      if (!ctx->needs_input_grad(saved.size() + j) || !record->parameters[j].requires_grad()) {
        continue;
      }
      sources.push_back(record->parameters[j]);
      source_slot.push_back(saved.size() + j);
    }
    CheckLeaves(*record, outputs, known);
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !outputs[i].requires_grad()) {
        continue;
      }
      roots.push_back(outputs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    // One per argument of forward: the inputs, the parameters, the record.
    std::vector<at::Tensor> grads(saved.size() + record->parameters.size() + 1);
    if (roots.empty() || sources.empty()) return grads;
    std::vector<at::Tensor> computed =
        torch::autograd::grad(roots, sources, root_grads, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < computed.size(); ++k) grads[source_slot[k]] = computed[k];
    return grads;
  }

  // Keeps the record alive in the node's saved data.
  struct RecordCapsule : torch::CustomClassHolder {
    explicit RecordCapsule(std::shared_ptr<RegionRecord> record) : record(std::move(record)) {}
    std::shared_ptr<RegionRecord> record;
  };
};

}  // namespace

int CheckpointedRegionsInGraph(const at::Tensor& output) {
  if (!output.defined() || !output.grad_fn()) return 0;
  int regions = 0;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{output.grad_fn().get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (dynamic_cast<torch::autograd::CppNode<CheckpointFunction>*>(node) != nullptr) ++regions;
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  return regions;
}

bool InCheckpointedRegion() { return t_region != nullptr; }

const std::string& CheckpointedRegionName() {
  static const std::string* const kNone = new std::string();
  return t_region != nullptr ? *t_region : *kNone;
}

std::vector<at::Tensor> Checkpoint(const std::string& name, const CheckpointBody& body,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters,
                                   const CheckpointOptions& options) {
  if (!c10::GradMode::is_enabled() || InCheckpointedRegion()) return body(inputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "activation checkpointing: input ", i, " of region '", name,
                "' is an undefined tensor; pass only defined tensors as inputs");
  }
  auto record = std::make_shared<RegionRecord>();
  record->name = name;
  record->body = body;
  // Once each: a shared module or tied weight appears once per path, and
  // each copy would deliver the whole gradient again.
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& p : parameters) {
    if (p.defined() && p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) {
      record->parameters.push_back(p);
    }
  }
  bool any_grad = !record->parameters.empty();
  for (const at::Tensor& input : inputs) any_grad = any_grad || input.requires_grad();
  if (!any_grad) return body(inputs);
  record->rng = CaptureRng(inputs, options);
  record->autocast = AutocastState::Current();
  const std::vector<at::Tensor> params = record->parameters;
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(params),
                                   std::move(record));
}

std::vector<at::Tensor> CheckpointedForward(const CheckpointableModule& module,
                                            const std::vector<at::Tensor>& inputs,
                                            const CheckpointBody& body) {
  if (!module.activation_checkpointing()) return body(inputs);
  const auto* as_module = dynamic_cast<const torch::nn::Module*>(&module);
  TORCH_CHECK(as_module != nullptr,
              "activation checkpointing: a CheckpointableModule must be a torch::nn::Module");
  return Checkpoint(module.region_name_, body, inputs, as_module->parameters(/*recurse=*/true),
                    module.checkpoint_options());
}

at::Tensor CheckpointedForward(const CheckpointableModule& module, const at::Tensor& input,
                               const std::function<at::Tensor(const at::Tensor&)>& body) {
  if (!module.activation_checkpointing()) return body(input);
  return CheckpointedForward(module, std::vector<at::Tensor>{input},
                             // By value: backward runs it after this returns.
                             [body](const std::vector<at::Tensor>& in) {
                               return std::vector<at::Tensor>{body(in[0])};
                             })[0];
}

namespace {

std::string DisplayFqn(const std::string& fqn) { return fqn.empty() ? std::string("(root)") : fqn; }

// Whether the module named `inner` is a descendant of the one named `outer`.
bool IsInside(const std::string& inner, const std::string& outer) {
  return outer.empty()
             ? !inner.empty()
             : inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
                   inner[outer.size()] == '.';
}

bool IsCheckpointed(torch::nn::Module* module) {
  auto* checkpointable = dynamic_cast<CheckpointableModule*>(module);
  return checkpointable != nullptr && checkpointable->activation_checkpointing();
}

using ChosenRegions = std::vector<std::pair<std::string, CheckpointableModule*>>;

// The policy's targets as checkpointable modules, refusing one that has no
// region to checkpoint or is checkpointed already.
absl::StatusOr<ChosenRegions> CheckpointableTargets(const std::vector<UnitTarget>& targets,
                                                    const WrapPolicy& policy) {
  ChosenRegions chosen;
  for (const UnitTarget& target : targets) {
    const std::string& fqn = target.fqn;
    auto* checkpointable =
        dynamic_cast<CheckpointableModule*>(const_cast<torch::nn::Module*>(target.module));
    if (checkpointable == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ApplyActivationCheckpointing: policy ", policy.Describe(), " chose '", DisplayFqn(fqn),
          "' (", target.module->name(),
          "), which is not an fsdp::CheckpointableModule: its forward has no region to "
          "checkpoint (derive from CheckpointableModule and run the math through "
          "CheckpointedForward, or hold a stock module in fsdp::UnitModule)"));
    }
    if (checkpointable->activation_checkpointing()) {
      return absl::InvalidArgumentError(absl::StrCat("ApplyActivationCheckpointing: '",
                                                     DisplayFqn(fqn),
                                                     "' is already checkpointed; nested or "
                                                     "repeated checkpointing is refused"));
    }
    chosen.emplace_back(fqn, checkpointable);
  }
  return chosen;
}

// Refuses a chosen module inside another chosen or already checkpointed
// one, and one with a checkpointed module inside it: the inner region
// would recompute inside the outer's recomputation.
absl::Status CheckNoNestedRegions(
    const ChosenRegions& chosen,
    const std::vector<std::pair<std::string, torch::nn::Module*>>& modules) {
  for (const auto& [fqn, m] : chosen) {
    for (const auto& [outer_fqn, outer] : modules) {
      if (!IsInside(fqn, outer_fqn)) continue;
      bool outer_chosen = false;
      for (const auto& [other_fqn, other] : chosen)
        outer_chosen = outer_chosen || other_fqn == outer_fqn;
      if (outer_chosen || IsCheckpointed(outer)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ApplyActivationCheckpointing: '", DisplayFqn(fqn), "' is inside '",
            DisplayFqn(outer_fqn),
            "', which is checkpointed too; nested checkpointing is refused (checkpoint one of "
            "them)"));
      }
    }
    for (const auto& [inner_fqn, inner] : modules) {
      if (IsInside(inner_fqn, fqn) && IsCheckpointed(inner)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ApplyActivationCheckpointing: '", DisplayFqn(fqn), "' contains '",
            DisplayFqn(inner_fqn),
            "', which is checkpointed already; nested checkpointing is refused"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ApplyActivationCheckpointing(
    torch::nn::Module& root, const WrapPolicy& policy, const CheckpointOptions& options) {
  PolicyInput input;
  input.root = &root;
  input.can_be_unit = [](const torch::nn::Module& m) {
    return dynamic_cast<const CheckpointableModule*>(&m) != nullptr;
  };
  input.is_excluded = [](const torch::nn::Module&) { return false; };
  absl::StatusOr<std::vector<UnitTarget>> targets = policy.Targets(input);
  if (!targets.ok()) return targets.status();
  // Every module with its FQN, to find ancestors by prefix.
  std::vector<std::pair<std::string, torch::nn::Module*>> modules;
  modules.emplace_back("", &root);
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    modules.emplace_back(item.key(), item.value().get());
  }
  absl::StatusOr<ChosenRegions> chosen = CheckpointableTargets(*targets, policy);
  if (!chosen.ok()) return chosen.status();
  if (absl::Status flat = CheckNoNestedRegions(*chosen, modules); !flat.ok()) return flat;
  if (chosen->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ApplyActivationCheckpointing: policy ", policy.Describe(),
                     " chose no module of the model (the root itself is never chosen)"));
  }
  std::vector<std::string> fqns;
  for (auto& [fqn, m] : *chosen) {
    m->checkpointing_ = true;
    m->options_ = options;
    m->region_name_ = fqn;
    fqns.push_back(fqn);
  }
  return fqns;
}

absl::Status RemoveActivationCheckpointing(torch::nn::Module& root) {
  std::vector<torch::nn::Module*> modules{&root};
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    modules.push_back(item.value().get());
  }
  for (torch::nn::Module* module : modules) {
    if (auto* m = dynamic_cast<CheckpointableModule*>(module)) {
      m->checkpointing_ = false;
      m->options_ = {};
      m->region_name_.clear();
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp
