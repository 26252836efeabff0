#include "optim/flat_shard_optimizers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "optim/optim_internal.h"
#include "torch/optim/serialize.h"
#include "torch/version.h"

namespace fsdp {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;
using torch::optim::OptimizerParamGroup;
using torch::optim::OptimizerParamState;
using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

at::Tensor OwnCopy(const at::Tensor& t) { return t.defined() ? t.clone() : t; }

// Loaded values go into the tensor the state already has when they fit it,
// so a state that views its run's buffer keeps viewing it.
void Assign(at::Tensor& dst, const at::Tensor& src) {
  if (dst.defined() && src.defined() && dst.sizes() == src.sizes() &&
      dst.scalar_type() == src.scalar_type() && dst.device() == src.device()) {
    at::NoGradGuard no_grad;
    dst.copy_(src);
  } else {
    dst = src;
  }
}

// libtorch's per-parameter states, serialized from copies of their own
// elements (a view would write its whole buffer) and loaded in place.
class FlatAdamWParamState final : public AdamWParamState {
 public:
  std::unique_ptr<OptimizerParamState> clone() const override {
    return std::make_unique<FlatAdamWParamState>(*this);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    AdamWParamState own(*this);
    own.exp_avg(OwnCopy(exp_avg()));
    own.exp_avg_sq(OwnCopy(exp_avg_sq()));
    own.max_exp_avg_sq(OwnCopy(max_exp_avg_sq()));
    own.serialize(archive);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    AdamWParamState read;
    read.serialize(archive);
    step(read.step());
    Assign(exp_avg(), read.exp_avg());
    Assign(exp_avg_sq(), read.exp_avg_sq());
    Assign(max_exp_avg_sq(), read.max_exp_avg_sq());
  }
};

class FlatSGDParamState final : public SGDParamState {
 public:
  std::unique_ptr<OptimizerParamState> clone() const override {
    return std::make_unique<FlatSGDParamState>(*this);
  }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    SGDParamState own(*this);
    own.momentum_buffer(OwnCopy(momentum_buffer()));
    own.serialize(archive);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    SGDParamState read;
    read.serialize(archive);
    Assign(momentum_buffer(), read.momentum_buffer());
  }
};

// One parameter a step updates (it has a gradient).
struct Member {
  at::Tensor param;
  at::Tensor grad;
  size_t group = 0;
  optim_internal::OptimizerStateKey key;
};

// Parameters stepped as one tensor: member i's elements are
// [starts[i], starts[i] + numel_i) of `param` and `grad`.
struct Run {
  std::vector<const Member*> members;
  std::vector<int64_t> starts;
  int64_t numel = 0;
  at::Tensor param, grad;
};

const void* StorageOf(const at::Tensor& t) {
  return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// Whether `next`'s elements lie right after `prev`'s in one storage.
bool Follows(const at::Tensor& prev, const at::Tensor& next) {
  return prev.numel() > 0 && next.numel() > 0 && prev.is_contiguous() && next.is_contiguous() &&
         prev.scalar_type() == next.scalar_type() && prev.device() == next.device() &&
         StorageOf(prev) != nullptr && StorageOf(prev) == StorageOf(next) &&
         prev.storage_offset() + prev.numel() == next.storage_offset();
}

// `numel` elements of `first`'s storage from `first`'s first element on.
at::Tensor FlatView(const at::Tensor& first, int64_t numel) {
  return at::empty({0}, first.options())
      .set_(first.storage(), first.storage_offset(), {numel}, {1});
}

// A run is stepped through a view with a version counter of its own:
// advance each parameter's as libtorch's in-place step does, so that a save
// reading them in place (checkpoint/async_checkpoint.h) sees the step.
void AdvanceVersions(const std::vector<Member>& members) {
  for (const Member& m : members) m.param.unsafeGetTensorImpl()->bump_version();
}

std::vector<Member> MembersOf(const std::vector<OptimizerParamGroup>& groups, const char* name) {
  std::vector<Member> members;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& p : groups[g].params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), name, " does not support sparse gradients");
      members.push_back(Member{p, p.grad(), g, optim_internal::StateKey(p)});
    }
  }
  return members;
}

// Members in storage order, cut into runs wherever the next member's data or
// gradient does not follow the previous one's, or `compatible` says it must
// step apart (other hyper-parameters, other step count).
std::vector<Run> FindRuns(const std::vector<Member>& members,
                          const std::function<bool(const Member&, const Member&)>& compatible) {
  std::vector<const Member*> order;
  for (const Member& m : members) order.push_back(&m);
  std::stable_sort(order.begin(), order.end(), [](const Member* a, const Member* b) {
    const auto sa = reinterpret_cast<uintptr_t>(StorageOf(a->param));
    const auto sb = reinterpret_cast<uintptr_t>(StorageOf(b->param));
    return std::make_tuple(sa, a->param.storage_offset()) <
           std::make_tuple(sb, b->param.storage_offset());
  });
  std::vector<Run> runs;
  for (const Member* m : order) {
    if (!runs.empty()) {
      Run& run = runs.back();
      const Member& last = *run.members.back();
      if (Follows(last.param, m->param) && Follows(last.grad, m->grad) &&
          compatible(*run.members.front(), *m)) {
        run.members.push_back(m);
        run.starts.push_back(run.numel);
        run.numel += m->param.numel();
        continue;
      }
    }
    runs.push_back(Run{{m}, {0}, m->param.numel(), m->param, m->grad});
  }
  for (Run& run : runs) {
    if (run.members.size() == 1) continue;
    run.param = FlatView(run.members.front()->param, run.numel);
    run.grad = FlatView(run.members.front()->grad, run.numel);
  }
  return runs;
}

// The run's buffer for one kind of state, given each member's tensor of that
// kind: the tensors themselves when they are already views of one buffer laid
// out as the run; else a new buffer holding their values (zeros where a
// member has none, as libtorch initializes state) with the members' tensors
// replaced by views of it.
at::Tensor RunBuffer(const Run& run, const std::vector<at::Tensor*>& tensors) {
  if (run.members.size() == 1) {
    at::Tensor& t = *tensors.front();
    if (!t.defined()) t = at::zeros_like(run.param, at::MemoryFormat::Preserve);
    return t;
  }
  const at::Tensor& first = *tensors.front();
  bool viewing = first.defined() && first.scalar_type() == run.param.scalar_type() &&
                 first.device() == run.param.device();
  for (size_t i = 0; viewing && i < tensors.size(); ++i) {
    const at::Tensor& t = *tensors[i];
    viewing = t.defined() && t.is_contiguous() && StorageOf(t) == StorageOf(first) &&
              t.scalar_type() == first.scalar_type() &&
              t.storage_offset() == first.storage_offset() + run.starts[i] &&
              t.numel() == run.members[i]->param.numel();
  }
  if (viewing) return FlatView(first, run.numel);
  at::Tensor buffer = at::zeros({run.numel}, run.param.options());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& param = run.members[i]->param;
    at::Tensor slice = buffer.narrow(0, run.starts[i], param.numel());
    at::Tensor& t = *tensors[i];
    if (t.defined()) {
      TORCH_CHECK(t.numel() == param.numel(), "optimizer state of ", t.numel(),
                  " elements for a parameter of ", param.numel());
      slice.copy_(t.reshape({-1}));
    }
    t = slice.view(param.sizes());
  }
  return buffer;
}

// PyTorch's fused AdamW and SGD kernels (one pass over the elements) on
// every device, CPU included, from torch 2.4 on (kHaveFusedOptimizerKernels,
// as a macro for #if).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define FSDP_HAVE_FUSED_OPTIMIZER_KERNELS 1
#else
#define FSDP_HAVE_FUSED_OPTIMIZER_KERNELS 0
#endif

void CheckKernel(FlatShardKernel kernel, const char* name) {
  TORCH_CHECK(kernel != FlatShardKernel::kFused || kHaveFusedOptimizerKernels, name,
              ": FlatShardKernel::kFused needs libtorch >= 2.4 (its fused optimizer kernels); "
              "this is libtorch ",
              TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ": use FlatShardKernel::kExact");
}

// Consecutive members of one parameter group: the elements [lo, lo + n) of
// the run that one learning rate and weight decay apply to.
struct Stretch {
  size_t group;
  int64_t lo, n;
};

std::vector<Stretch> StretchesOf(const Run& run) {
  std::vector<Stretch> stretches;
  for (size_t i = 0; i < run.members.size(); ++i) {
    const size_t group = run.members[i]->group;
    if (!stretches.empty() && stretches.back().group == group) {
      stretches.back().n += run.members[i]->param.numel();
    } else {
      stretches.push_back({group, run.starts[i], run.members[i]->param.numel()});
    }
  }
  return stretches;
}

// Whether a run's tensors can be stepped as 1-D tensors (views of their
// elements in order): always for a run of several (its tensors are views of
// one buffer each); for a parameter alone, when its parameter, gradient and
// state are all contiguous, of one shape and one dtype. Others are stepped
// whole, with libtorch's ops, which handle any layout.
bool SteppableFlat(const Run& run, const std::vector<at::Tensor>& state) {
  if (run.members.size() > 1) return true;
  const at::Tensor& p = run.param;
  bool flat = p.is_contiguous() && run.grad.is_contiguous() && run.grad.sizes() == p.sizes() &&
              run.grad.scalar_type() == p.scalar_type();
  for (const at::Tensor& t : state) {
    flat = flat && (!t.defined() || (t.is_contiguous() && t.sizes() == p.sizes() &&
                                     t.scalar_type() == p.scalar_type()));
  }
  return flat;
}

// Every op of a step runs over one chunk of the run before the next chunk:
// a unit's flat shard can be larger than the caches, and op after op over
// all of it streams it from memory each time (measured before chunking: 3x
// slower than libtorch's per-parameter step on the 8-layer GPT of
// //models:optimizer_step_benchmark). Chunks of 2^19 elements keep the few
// tensors an op touches in the last-level cache; smaller ones pay ATen's
// per-op and intra-op thread start-up more often (2^15: 2x slower than
// libtorch's step; 2^17 to 2^21 all within the run-to-run spread of it).
constexpr int64_t kChunkElements = int64_t{1} << 19;

// One chunk [lo, lo + n) of a run's 1-D tensors, or, for a run stepped
// whole, the whole tensors.
class Chunk {
 public:
  Chunk(int64_t lo, int64_t n, bool whole) : lo_(lo), n_(n), whole_(whole) {}
  // The chunk of a run-sized tensor.
  at::Tensor operator()(const at::Tensor& t) const { return whole_ ? t : t.narrow(0, lo_, n_); }
  // The part of a run-sized tensor (`in_chunk` false) or of a chunk-sized
  // one (true) that lies in both this chunk and `s`; undefined if none.
  at::Tensor Part(const at::Tensor& t, const Stretch& s, bool in_chunk) const {
    if (whole_) return t;
    const int64_t a = std::max(lo_, s.lo), b = std::min(lo_ + n_, s.lo + s.n);
    if (a >= b) return at::Tensor();
    return t.narrow(0, in_chunk ? a - lo_ : a, b - a);
  }
  int64_t size() const { return n_; }

 private:
  int64_t lo_, n_;
  bool whole_;
};

void ForEachChunk(const at::Tensor& param, bool flat,
                  const std::function<void(const Chunk&)>& body) {
  if (!flat) {
    body(Chunk(0, 0, /*whole=*/true));
    return;
  }
  const int64_t numel = param.numel();
  for (int64_t lo = 0; lo < numel; lo += kChunkElements) {
    body(Chunk(lo, std::min(kChunkElements, numel - lo), /*whole=*/false));
  }
}

at::Tensor Flat(const at::Tensor& t, bool flat) { return flat && t.defined() ? t.view({-1}) : t; }

// Temporaries of one step, allocated once and reused by every chunk.
class Scratch {
 public:
  // A chunk-sized temporary for tensors like `chunk_of_param`.
  at::Tensor Like(const at::Tensor& chunk_of_param, const Chunk& chunk, int slot) {
    if (chunk_of_param.dim() != 1) return at::empty_like(chunk_of_param);
    at::Tensor& buffer = buffers_[slot];
    if (!buffer.defined() || buffer.numel() < chunk.size() ||
        buffer.scalar_type() != chunk_of_param.scalar_type() ||
        buffer.device() != chunk_of_param.device()) {
      buffer = at::empty({std::max(chunk.size(), kChunkElements)}, chunk_of_param.options());
    }
    return buffer.narrow(0, 0, chunk.size());
  }

 private:
  at::Tensor buffers_[2];
};

// The tensors of one fused kernel call, and its key: the hyper-parameters,
// dtype and device it is for (the kernels take one of each per call).
struct FusedCall {
  std::vector<at::Tensor> params, grads, buffers1, buffers2, buffers3, steps;
};
using FusedCalls = std::map<std::vector<double>, FusedCall>;

std::vector<double> FusedKey(const at::Tensor& param, std::vector<double> hyperparameters) {
  hyperparameters.push_back(static_cast<double>(param.scalar_type()));
  hyperparameters.push_back(static_cast<double>(param.device().type()));
  hyperparameters.push_back(static_cast<double>(param.device().index()));
  return hyperparameters;
}

void Count(const std::vector<Run>& runs, FlatStepStats& stats) {
  stats = FlatStepStats{};
  for (const Run& run : runs) {
    ++stats.runs;
    stats.params += static_cast<int64_t>(run.members.size());
    if (run.members.size() > 1) stats.fused_params += static_cast<int64_t>(run.members.size());
  }
}

using LossClosure = torch::optim::Optimizer::LossClosure;
using ParamStates = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

template <typename Options>
const Options& GroupOptions(const std::vector<OptimizerParamGroup>& groups, size_t group) {
  return static_cast<const Options&>(groups[group].options());
}

// What both optimizers' steps start with. The closure runs with gradients
// enabled although the step itself runs without, as libtorch's steps do;
// the members are read after it, since it is what computes the gradients.
struct StepStart {
  at::Tensor loss;
  std::vector<Member> members;
};

StepStart BeginStep(const LossClosure& closure, const std::vector<OptimizerParamGroup>& groups,
                    const char* name) {
  StepStart start;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    start.loss = closure();
  }
  start.members = MembersOf(groups, name);
  return start;
}

// A run's parameter and gradient as its step updates them: 1-D when the run
// steps flat (SteppableFlat), with the stretches of its parameter groups.
struct RunView {
  bool flat = false;
  at::Tensor param, grad;
  std::vector<Stretch> stretches;
};

RunView ViewOf(const Run& run, const std::vector<at::Tensor>& state) {
  RunView view;
  view.flat = SteppableFlat(run, state);
  view.param = Flat(run.param, view.flat);
  view.grad = Flat(run.grad, view.flat);
  view.stretches = StretchesOf(run);
  return view;
}

// The fused kernels take flat tensors, and a gradient of the parameter's dtype.
bool UsesFusedKernel(FlatShardKernel kernel, const RunView& view) {
  return kernel == FlatShardKernel::kFused && view.flat &&
         view.grad.scalar_type() == view.param.scalar_type();
}

// --- AdamW ---------------------------------------------------------------------

AdamWParamState& AdamWStateOf(ParamStates& states, const Member& m) {
  std::unique_ptr<OptimizerParamState>& slot = states[m.key];
  if (slot == nullptr) slot = std::make_unique<FlatAdamWParamState>();
  return static_cast<AdamWParamState&>(*slot);
}

// One run's AdamW step: its view, its state as run buffers (1-D when it
// steps flat), and the step count after this step.
struct AdamWRun {
  RunView view;
  const AdamWOptions* first = nullptr;  // Its first member's group's.
  double beta1 = 0, beta2 = 0;
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  int64_t step = 0;
};

// The run's state gathered into run buffers. The members' new step counts
// go to `steps`, for the caller to set once every run stepped.
AdamWRun PrepareAdamWRun(const Run& run, const std::vector<OptimizerParamGroup>& groups,
                         ParamStates& states,
                         std::vector<std::pair<AdamWParamState*, int64_t>>& steps) {
  AdamWRun r;
  r.first = &GroupOptions<AdamWOptions>(groups, run.members.front()->group);
  r.beta1 = std::get<0>(r.first->betas());
  r.beta2 = std::get<1>(r.first->betas());
  std::vector<at::Tensor*> exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  for (const Member* m : run.members) {
    AdamWParamState& s = AdamWStateOf(states, *m);
    exp_avgs.push_back(&s.exp_avg());
    exp_avg_sqs.push_back(&s.exp_avg_sq());
    max_exp_avg_sqs.push_back(&s.max_exp_avg_sq());
  }
  at::Tensor exp_avg = RunBuffer(run, exp_avgs);
  at::Tensor exp_avg_sq = RunBuffer(run, exp_avg_sqs);
  at::Tensor max_exp_avg_sq = r.first->amsgrad() ? RunBuffer(run, max_exp_avg_sqs) : at::Tensor();
  r.view = ViewOf(run, {exp_avg, exp_avg_sq, max_exp_avg_sq});
  r.exp_avg = Flat(exp_avg, r.view.flat);
  r.exp_avg_sq = Flat(exp_avg_sq, r.view.flat);
  r.max_exp_avg_sq = Flat(max_exp_avg_sq, r.view.flat);
  r.step = AdamWStateOf(states, *run.members.front()).step() + 1;
  for (const Member* m : run.members) steps.emplace_back(&AdamWStateOf(states, *m), r.step);
  return r;
}

void QueueFusedAdamW(const AdamWRun& r, const std::vector<OptimizerParamGroup>& groups,
                     FusedCalls& fused) {
  const at::Tensor& param = r.view.param;
  const at::Tensor& grad = r.view.grad;
  for (const Stretch& s : r.view.stretches) {
    const AdamWOptions& o = GroupOptions<AdamWOptions>(groups, s.group);
    FusedCall& call =
        fused[FusedKey(param, {o.lr(), o.weight_decay(), o.eps(), static_cast<double>(r.step),
                               r.beta1, r.beta2, o.amsgrad() ? 1.0 : 0.0})];
    call.params.push_back(param.narrow(0, s.lo, s.n));
    call.grads.push_back(grad.narrow(0, s.lo, s.n));
    call.buffers1.push_back(r.exp_avg.narrow(0, s.lo, s.n));
    call.buffers2.push_back(r.exp_avg_sq.narrow(0, s.lo, s.n));
    if (o.amsgrad()) call.buffers3.push_back(r.max_exp_avg_sq.narrow(0, s.lo, s.n));
    // The kernel takes the step count after this step's increment, and
    // only reads it: the key holds the step, so one tensor serves the
    // whole call (a tensor per stretch cost an allocation and, on a
    // GPU, a fill kernel each).
    if (call.steps.empty()) {
      call.steps.push_back(
          at::full({}, static_cast<double>(r.step), param.options().dtype(at::kFloat)));
    } else {
      call.steps.push_back(call.steps.front());
    }
  }
}

// libtorch's AdamW step, op for op; the two ops whose scalars depend on
// the group (learning rate, weight decay) once per group's stretch.
void StepAdamWExact(const AdamWRun& r, const std::vector<OptimizerParamGroup>& groups,
                    Scratch& scratch) {
  const AdamWOptions& first = *r.first;
  const double beta1 = r.beta1;
  const double beta2 = r.beta2;
  const at::Tensor& param = r.view.param;
  const at::Tensor& grad = r.view.grad;
  const at::Tensor& exp_avg = r.exp_avg;
  const at::Tensor& exp_avg_sq = r.exp_avg_sq;
  const at::Tensor& max_exp_avg_sq = r.max_exp_avg_sq;
  const std::vector<Stretch>& stretches = r.view.stretches;
  const auto options = [&](size_t group) -> const AdamWOptions& {
    return GroupOptions<AdamWOptions>(groups, group);
  };
  const double bias_correction1 = 1 - std::pow(beta1, r.step);
  const double bias_correction2 = 1 - std::pow(beta2, r.step);
  ForEachChunk(param, r.view.flat, [&](const Chunk& chunk) {
    for (const Stretch& s : stretches) {
      const AdamWOptions& o = options(s.group);
      at::Tensor p = chunk.Part(param, s, false);
      if (p.defined() && o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
    }
    const at::Tensor g = chunk(grad);
    at::Tensor m = chunk(exp_avg);
    at::Tensor v = chunk(exp_avg_sq);
    m.mul_(beta1).add_(g, 1 - beta1);
    v.mul_(beta2).addcmul_(g, g, 1 - beta2);
    at::Tensor denom = scratch.Like(v, chunk, 0);
    if (first.amsgrad()) {
      at::Tensor max_v = chunk(max_exp_avg_sq);
      at::max_out(max_v, v, max_v);
      at::sqrt_out(denom, max_v);
    } else {
      at::sqrt_out(denom, v);
    }
    denom.div_(std::sqrt(bias_correction2)).add_(first.eps());
    for (const Stretch& s : stretches) {
      at::Tensor p = chunk.Part(param, s, false);
      if (!p.defined()) continue;
      p.addcdiv_(chunk.Part(exp_avg, s, false), chunk.Part(denom, s, true),
                 -(options(s.group).lr() / bias_correction1));
    }
  });
}

void RunFusedAdamW([[maybe_unused]] FusedCalls& fused) {
#if FSDP_HAVE_FUSED_OPTIMIZER_KERNELS
  for (auto& [key, call] : fused) {
    at::_fused_adamw_(call.params, call.grads, call.buffers1, call.buffers2, call.buffers3,
                      call.steps, /*lr=*/key[0], /*beta1=*/key[4], /*beta2=*/key[5],
                      /*weight_decay=*/key[1], /*eps=*/key[2], /*amsgrad=*/key[6] != 0,
                      /*maximize=*/false);
  }
#endif
}

// --- SGD -----------------------------------------------------------------------

// Only momentum has state; null without it, as libtorch keeps none.
SGDParamState* SgdStateOf(ParamStates& states, const Member& m) {
  auto it = states.find(m.key);
  return it == states.end() ? nullptr : static_cast<SGDParamState*>(it->second.get());
}

bool HasMomentum(ParamStates& states, const Member& m) {
  const SGDParamState* s = SgdStateOf(states, m);
  return s != nullptr && s->momentum_buffer().defined();
}

// One run's SGD step: its view and its momentum buffer (undefined without
// momentum; 1-D when it steps flat). `fresh`: the buffer is new this step.
struct SgdRun {
  RunView view;
  const SGDOptions* first = nullptr;  // Its first member's group's.
  bool fresh = false;
  at::Tensor buffer;
};

// The run's momentum buffers gathered into a run buffer. A run without them
// yet gets a new one, filled with the step's update as libtorch's first
// buffer is; its members' views of it go to `fresh_buffers`, for the caller
// to install once every run stepped.
SgdRun PrepareSgdRun(
    const Run& run, const std::vector<OptimizerParamGroup>& groups, ParamStates& states,
    std::vector<std::pair<optim_internal::OptimizerStateKey, at::Tensor>>& fresh_buffers) {
  SgdRun r;
  r.first = &GroupOptions<SGDOptions>(groups, run.members.front()->group);
  r.fresh = r.first->momentum() != 0 && !HasMomentum(states, *run.members.front());
  at::Tensor buffer;
  if (r.fresh) {
    buffer = at::empty_like(run.param);
    for (size_t i = 0; i < run.members.size(); ++i) {
      const Member& m = *run.members[i];
      fresh_buffers.emplace_back(
          m.key, run.members.size() == 1
                     ? buffer
                     : buffer.narrow(0, run.starts[i], m.param.numel()).view(m.param.sizes()));
    }
  } else if (r.first->momentum() != 0) {
    std::vector<at::Tensor*> buffers;
    for (const Member* m : run.members) {
      buffers.push_back(&SgdStateOf(states, *m)->momentum_buffer());
    }
    buffer = RunBuffer(run, buffers);
  }
  r.view = ViewOf(run, {buffer});
  r.buffer = Flat(buffer, r.view.flat);
  return r;
}

void QueueFusedSgd(const SgdRun& r, const std::vector<OptimizerParamGroup>& groups,
                   FusedCalls& fused) {
  for (const Stretch& s : r.view.stretches) {
    const SGDOptions& o = GroupOptions<SGDOptions>(groups, s.group);
    FusedCall& call =
        fused[FusedKey(r.view.param, {o.lr(), o.weight_decay(), o.momentum(), o.dampening(),
                                      o.nesterov() ? 1.0 : 0.0, r.fresh ? 1.0 : 0.0})];
    call.params.push_back(r.view.param.narrow(0, s.lo, s.n));
    call.grads.push_back(r.view.grad.narrow(0, s.lo, s.n));
    if (o.momentum() != 0) call.buffers1.push_back(r.buffer.narrow(0, s.lo, s.n));
  }
}

// libtorch's SGD step, op for op; weight decay and the learning rate
// once per group's stretch.
void StepSgdExact(const SgdRun& r, const std::vector<OptimizerParamGroup>& groups,
                  Scratch& scratch) {
  const SGDOptions& first = *r.first;
  const bool fresh = r.fresh;
  const bool flat = r.view.flat;
  const at::Tensor& param = r.view.param;
  const at::Tensor& grad = r.view.grad;
  const at::Tensor& buffer = r.buffer;
  const std::vector<Stretch>& stretches = r.view.stretches;
  const auto options = [&](size_t group) -> const SGDOptions& {
    return GroupOptions<SGDOptions>(groups, group);
  };
  bool decays = false;
  for (const Stretch& s : stretches) decays = decays || options(s.group).weight_decay() != 0;
  ForEachChunk(param, flat, [&](const Chunk& chunk) {
    at::Tensor d_p = chunk(grad);
    if (decays && !flat) {
      d_p = d_p.add(param, options(stretches.front().group).weight_decay());
    } else if (decays) {
      d_p = scratch.Like(d_p, chunk, 0);
      for (const Stretch& s : stretches) {
        at::Tensor out = chunk.Part(d_p, s, true);
        if (!out.defined()) continue;
        const double weight_decay = options(s.group).weight_decay();
        if (weight_decay != 0) {
          at::add_out(out, chunk.Part(grad, s, false), chunk.Part(param, s, false), weight_decay);
        } else {
          out.copy_(chunk.Part(grad, s, false));
        }
      }
    }
    if (first.momentum() != 0) {
      at::Tensor buf = chunk(buffer);
      if (fresh) {
        buf.copy_(d_p);
      } else {
        buf.mul_(first.momentum()).add_(d_p, 1 - first.dampening());
      }
      if (first.nesterov() && !flat) {
        d_p = d_p.add(buf, first.momentum());
      } else if (first.nesterov()) {
        at::Tensor out = scratch.Like(d_p, chunk, 1);
        d_p = at::add_out(out, d_p, buf, first.momentum());
      } else {
        d_p = buf;
      }
    }
    for (const Stretch& s : stretches) {
      at::Tensor p = chunk.Part(param, s, false);
      if (p.defined()) p.add_(chunk.Part(d_p, s, true), -1 * options(s.group).lr());
    }
  });
}

void RunFusedSgd([[maybe_unused]] FusedCalls& fused) {
#if FSDP_HAVE_FUSED_OPTIMIZER_KERNELS
  for (auto& [key, call] : fused) {
    at::_fused_sgd_(call.params, call.grads, call.buffers1, /*weight_decay=*/key[1],
                    /*momentum=*/key[2], /*lr=*/key[0], /*dampening=*/key[3],
                    /*nesterov=*/key[4] != 0, /*maximize=*/false, /*is_first_step=*/key[5] != 0);
  }
#endif
}

}  // namespace

FlatShardAdamW::FlatShardAdamW(std::vector<OptimizerParamGroup> param_groups, AdamWOptions defaults,
                               FlatShardKernel kernel)
    : torch::optim::AdamW(std::move(param_groups), defaults), kernel_(kernel) {
  CheckKernel(kernel, "FlatShardAdamW");
  optim_internal::ReadStateAsItsBase(typeid(FlatAdamWParamState), typeid(AdamWParamState));
}

FlatShardAdamW::FlatShardAdamW(std::vector<at::Tensor> params, AdamWOptions defaults,
                               FlatShardKernel kernel)
    : FlatShardAdamW({OptimizerParamGroup(std::move(params))}, defaults, kernel) {}

at::Tensor FlatShardAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const StepStart start = BeginStep(closure, param_groups_, "FlatShardAdamW");
  for (const Member& m : start.members) AdamWStateOf(state_, m);
  const std::vector<Run> runs = FindRuns(start.members, [&](const Member& a, const Member& b) {
    const AdamWOptions& oa = GroupOptions<AdamWOptions>(param_groups_, a.group);
    const AdamWOptions& ob = GroupOptions<AdamWOptions>(param_groups_, b.group);
    return oa.betas() == ob.betas() && oa.eps() == ob.eps() && oa.amsgrad() == ob.amsgrad() &&
           AdamWStateOf(state_, a).step() == AdamWStateOf(state_, b).step();
  });
  FusedCalls fused;  // By lr, weight decay, eps, step, betas, amsgrad, dtype, device.
  std::vector<std::pair<AdamWParamState*, int64_t>> steps;  // Set once every run stepped.
  Scratch scratch;
  for (const Run& run : runs) {
    const AdamWRun r = PrepareAdamWRun(run, param_groups_, state_, steps);
    if (UsesFusedKernel(kernel_, r.view)) {
      QueueFusedAdamW(r, param_groups_, fused);
    } else {
      StepAdamWExact(r, param_groups_, scratch);
    }
  }
  RunFusedAdamW(fused);
  for (auto& [s, step] : steps) s->step(step);
  AdvanceVersions(start.members);
  Count(runs, stats_);
  return start.loss;
}

// Saved as the base state type (each state's own serialize() still runs),
// loaded as ours.
void FlatShardAdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdamWParamState, AdamWOptions>(archive, *this);
}

void FlatShardAdamW::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FlatAdamWParamState, AdamWOptions>(archive, *this);
}

FlatShardSGD::FlatShardSGD(std::vector<OptimizerParamGroup> param_groups, SGDOptions defaults,
                           FlatShardKernel kernel)
    : torch::optim::SGD(std::move(param_groups), defaults), kernel_(kernel) {
  CheckKernel(kernel, "FlatShardSGD");
  optim_internal::ReadStateAsItsBase(typeid(FlatSGDParamState), typeid(SGDParamState));
}

FlatShardSGD::FlatShardSGD(std::vector<at::Tensor> params, SGDOptions defaults,
                           FlatShardKernel kernel)
    : FlatShardSGD({OptimizerParamGroup(std::move(params))}, defaults, kernel) {}

at::Tensor FlatShardSGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const StepStart start = BeginStep(closure, param_groups_, "FlatShardSGD");
  const std::vector<Run> runs = FindRuns(start.members, [&](const Member& a, const Member& b) {
    const SGDOptions& oa = GroupOptions<SGDOptions>(param_groups_, a.group);
    const SGDOptions& ob = GroupOptions<SGDOptions>(param_groups_, b.group);
    return oa.momentum() == ob.momentum() && oa.dampening() == ob.dampening() &&
           oa.nesterov() == ob.nesterov() && HasMomentum(state_, a) == HasMomentum(state_, b);
  });
  FusedCalls fused;  // By lr, weight decay, momentum, dampening, nesterov, first, dtype, device.
  std::vector<std::pair<optim_internal::OptimizerStateKey, at::Tensor>> fresh_buffers;
  Scratch scratch;
  for (const Run& run : runs) {
    const SgdRun r = PrepareSgdRun(run, param_groups_, state_, fresh_buffers);
    if (UsesFusedKernel(kernel_, r.view)) {
      QueueFusedSgd(r, param_groups_, fused);
    } else {
      StepSgdExact(r, param_groups_, scratch);
    }
  }
  RunFusedSgd(fused);
  for (auto& [key, buffer] : fresh_buffers) {
    auto s = std::make_unique<FlatSGDParamState>();
    s->momentum_buffer(buffer);
    state_[key] = std::move(s);
  }
  AdvanceVersions(start.members);
  Count(runs, stats_);
  return start.loss;
}

void FlatShardSGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void FlatShardSGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<FlatSGDParamState, SGDOptions>(archive, *this);
}

}  // namespace fsdp
