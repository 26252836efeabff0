// Any libtorch module as an FSDP unit, with no edits to it: UnitModule holds
// a module and opens the unit's UnitForward scope around its forward,
// whatever that forward takes and returns — one tensor or several,
// optional tensors, numbers and other values, containers of tensors; a
// tensor, a tuple, or a struct of tensors. It is also a
// CheckpointableModule (fsdp/activation_checkpointing.h): selected by
// ApplyActivationCheckpointing, the held module's forward is recomputed in
// backward, inside the unit's scope.
//
//   fsdp::UnitModule model(torch::nn::Sequential(
//       fsdp::UnitModule(torch::nn::TransformerEncoderLayer(options)),
//       fsdp::UnitModule(torch::nn::TransformerEncoderLayer(options)),
//       torch::nn::Linear(d_model, d_model)));
//   auto wrapped = fsdp::FullyShardedModel::Wrap(
//       model.ptr(), group, {}, *fsdp::ModuleTypePolicy::Of<fsdp::UnitModuleImpl>());
//
//   fsdp::UnitModule block{LlamaBlock(config)};   // forward(x, rotary, mask)
//   at::Tensor y = block->forward(x, rotary, mask);
//
// UnitModule<M> is deduced from the module given (a holder such as
// torch::nn::Linear, or a shared_ptr<M>); a member is declared
// fsdp::UnitModule<LinearImpl> layer{nullptr}. (Braces, as above, where the
// argument names a type: `UnitModule b(Block());` declares a function.)
// Its forward has the held forward's signature when that forward is one
// non-template function, so a UnitModule stands in a Sequential where the
// held module would, default arguments included (TransformerEncoderLayer's
// masks, which a direct call must then pass: forward(x, {}, {})). A held
// forward that is a template or overloaded (Sequential's) is called through
// a template, so such a UnitModule is a root or a member, not an element of
// another Sequential.
//
// What the scope sees. Every tensor among the arguments, also inside
// optionals, vectors, pairs and tuples, is a forward input: cast by the
// unit's mixed precision (UnitForward::Input) and, when checkpointed, an
// input of the region. Every tensor of the result is an output: the unit's
// pre-backward hook is armed on it and its output cast applied. A struct
// among the arguments or in the result says where its tensors are by a
// specialization of fsdp::TensorFields (below; fsdp::NoTensorFields for one
// without tensors, a config); one that does not is a compile error, since a
// tensor FSDP cannot see would miss its hooks. Numbers, strings, devices
// and scalars pass as they are. The held forward gets copies of its
// arguments, kept for a recompute in backward: parameters taken by
// non-const or rvalue reference, and views (pointers, string_view,
// IntArrayRef) a recompute could outlive, are compile errors.
//
// The root is a UnitModule too (or a module of one's own that opens the
// scope): FSDP needs a hook on the root's forward. Which UnitModules become
// units is still the policy's choice; one the policy leaves out only
// forwards.
//
// Names are those of the held module: a UnitModule registers the held
// module's own parameters, buffers and submodules under their names, so
// state dict keys and FQNs equal the unwrapped model's ("0.linear1.weight",
// not "0.inner.linear1.weight"); train()/eval() reach the held module.
//
// The held module itself is not in the module tree, where the UnitModule
// stands in for it: FsdpOptions::param_init_fn, Module::apply,
// fsdp::Apply and policies that select by type see the
// UnitModule (inner() reaches the held module; policies select
// UnitModuleImpl, the base of every UnitModule<M>), and ignored_modules must
// name the UnitModule. Tensors the held module registers after wrapping
// (reset()) are not the UnitModule's; clone() is not supported.
#ifndef FSDP_FSDP_UNIT_MODULE_H_
#define FSDP_FSDP_UNIT_MODULE_H_

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "c10/core/Device.h"
#include "c10/core/Scalar.h"
#include "c10/core/ScalarType.h"
#include "c10/util/ArrayRef.h"
#include "fsdp/activation_checkpointing.h"
#include "fsdp/unit_forward.h"
#include "fsdp/wrap_plan.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/any_value.h"
#include "torch/nn/pimpl.h"

namespace fsdp {

// Where a struct passed to or returned by a held forward keeps its tensors:
//
//   template <>
//   struct fsdp::TensorFields<BlockOutput> {
//     template <typename F>
//     static void ForEach(BlockOutput& out, F&& f) { f(out.hidden); f(out.aux); }
//   };
//
// ForEach calls f(at::Tensor&) on every tensor field, in a fixed order (it
// may also pass containers of tensors to fsdp::ForEachTensor).
template <typename T>
struct TensorFields;

// For a struct that holds no tensors (a config):
//   template <> struct fsdp::TensorFields<LlamaConfig> : fsdp::NoTensorFields {};
struct NoTensorFields {
  template <typename T, typename F>
  static void ForEach(T&, F&&) {}
};

namespace unit_module_internal {

template <typename T, typename = void>
struct HasTensorFields : std::false_type {};
template <typename T>
struct HasTensorFields<T, std::void_t<decltype(sizeof(TensorFields<T>))>> : std::true_type {};

template <typename T, typename = void>
struct IsOptionalLike : std::false_type {};
template <typename T>
struct IsOptionalLike<T, std::void_t<decltype(std::declval<T&>().has_value()),
                                     decltype(*std::declval<T&>())>> : std::true_type {};

template <typename T>
struct IsVector : std::false_type {};
template <typename T, typename A>
struct IsVector<std::vector<T, A>> : std::true_type {};
template <typename T>
struct IsTupleLike : std::false_type {};
template <typename... T>
struct IsTupleLike<std::tuple<T...>> : std::true_type {};
template <typename A, typename B>
struct IsTupleLike<std::pair<A, B>> : std::true_type {};
template <typename T, size_t N>
struct IsTupleLike<std::array<T, N>> : std::true_type {};

// Values that hold no tensor and own what they refer to (a checkpointed
// region calls the forward again in backward, with copies of them).
template <typename T>
inline constexpr bool kTensorFree =
    std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_same_v<T, std::string> ||
    std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, c10::Scalar> ||
    std::is_same_v<T, c10::Device>;

// Views of memory the caller owns, which a recompute in backward could
// outlive.
template <typename T>
inline constexpr bool kView = std::is_pointer_v<T> || std::is_same_v<T, std::string_view> ||
                              std::is_same_v<T, c10::IntArrayRef>;

template <typename T>
inline constexpr bool kAlwaysFalse = false;

}  // namespace unit_module_internal

// Calls f(at::Tensor&) on every tensor in `value` (see TensorFields), in
// order, undefined ones included.
template <typename T, typename F>
void ForEachTensor(T& value, F&& f) {
  using namespace unit_module_internal;
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    f(value);
  } else if constexpr (kTensorFree<U>) {
    // Nothing to visit.
  } else if constexpr (kView<U>) {
    static_assert(kAlwaysFalse<U>,
                  "fsdp::UnitModule: an argument of the held forward is a view (a pointer, "
                  "string_view, IntArrayRef) that a recompute in backward could outlive: pass "
                  "an owning value (std::string, std::vector<int64_t>)");
  } else if constexpr (HasTensorFields<U>::value) {
    TensorFields<U>::ForEach(value, f);
  } else if constexpr (IsOptionalLike<U>::value) {
    if (value.has_value()) ForEachTensor(*value, f);
  } else if constexpr (IsVector<U>::value) {
    for (auto& element : value) ForEachTensor(element, f);
  } else if constexpr (IsTupleLike<U>::value) {
    std::apply([&](auto&... element) { (ForEachTensor(element, f), ...); }, value);
  } else {
    static_assert(kAlwaysFalse<U>,
                  "fsdp::UnitModule: an argument or result of the held forward is a type whose "
                  "tensors FSDP cannot find: specialize fsdp::TensorFields for it "
                  "(fsdp/unit_module.h)");
  }
}

// The base of every UnitModule<M>: the names, the mode and the scope's
// bookkeeping; policies select it.
class UnitModuleImpl : public torch::nn::Module,
                       public ShardableModule,
                       public CheckpointableModule {
 public:
  const std::shared_ptr<torch::nn::Module>& inner() const { return inner_; }

  // Also sets the held module's mode (its forward may read it).
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

  // A Sequential calls these to fill in the held forward's default
  // arguments (FORWARD_HAS_DEFAULT_ARGS); they answer for the held module.
  bool _forward_has_default_args() override;
  unsigned int _forward_num_required_args() override;
  std::vector<torch::nn::AnyValue> _forward_populate_default_args(
      std::vector<torch::nn::AnyValue>&& arguments) override;

 protected:
  explicit UnitModuleImpl(std::shared_ptr<torch::nn::Module> inner);

  // Runs `call(args...)` inside the unit's scope (see the top).
  template <typename Call, typename... Args>
  auto ScopedForward(const Call& call, Args&&... args);

 private:
  std::shared_ptr<torch::nn::Module> inner_;
};

namespace unit_module_internal {

template <typename T>
std::vector<at::Tensor> DefinedTensors(T& value) {
  std::vector<at::Tensor> tensors;
  ForEachTensor(value, [&](at::Tensor& t) {
    if (t.defined()) tensors.push_back(t);
  });
  return tensors;
}

template <typename T>
void ReplaceDefinedTensors(T& value, const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  ForEachTensor(value, [&](at::Tensor& t) {
    if (t.defined()) t = tensors.at(next++);
  });
}

}  // namespace unit_module_internal

template <typename Call, typename... Args>
auto UnitModuleImpl::ScopedForward(const Call& call, Args&&... args) {
  using namespace unit_module_internal;
  UnitForward unit(this);
  auto inputs = std::make_tuple(std::decay_t<Args>(std::forward<Args>(args))...);
  ForEachTensor(inputs, [&](at::Tensor& t) {
    if (t.defined()) t = unit.Input(t);
  });
  using Result = std::decay_t<decltype(std::apply(call, inputs))>;
  static_assert(!std::is_void_v<Result>, "fsdp::UnitModule: the held forward returns nothing");
  // The region's body sees tensors only: the arguments' tensors come in, the
  // result's go out, and the first call's result keeps its shape for the
  // rebuild below (the recompute's is not kept).
  struct FirstResult {
    std::optional<Result> value;
    bool taken = false;
  };
  auto first = std::make_shared<FirstResult>();
  CheckpointBody body = [call, inputs, first](const std::vector<at::Tensor>& tensors) {
    auto arguments = inputs;
    ReplaceDefinedTensors(arguments, tensors);
    Result result = std::apply(call, arguments);
    std::vector<at::Tensor> outputs = DefinedTensors(result);
    if (!first->taken) {
      first->value.emplace(std::move(result));
      first->taken = true;
    }
    return outputs;
  };
  std::vector<at::Tensor> outputs = CheckpointedForward(*this, DefinedTensors(inputs), body);
  Result result = std::move(*first->value);
  first->value.reset();
  ReplaceDefinedTensors(result, unit.Return(std::move(outputs)));
  return result;
}

namespace unit_module_internal {

template <typename M, typename = void>
struct ForwardSignature {
  static constexpr bool kKnown = false;
};
template <typename M>
struct ForwardSignature<M, std::void_t<decltype(&M::forward)>> {
  static constexpr bool kKnown = true;
  using Type = decltype(&M::forward);
};

}  // namespace unit_module_internal

// UnitModule<M>'s module: the held forward's signature, or a template.
template <typename M, typename Signature = void>
class UnitModuleOf : public UnitModuleImpl {
 public:
  explicit UnitModuleOf(std::shared_ptr<M> inner) : UnitModuleImpl(inner), held_(std::move(inner)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    return ScopedForward([m = held_](auto&... a) { return m->forward(a...); },
                         std::forward<Args>(args)...);
  }

 private:
  std::shared_ptr<M> held_;
};

namespace unit_module_internal {

// The held forward gets copies of the arguments (kept for a recompute), so
// it cannot write through a parameter or take one over.
template <typename A>
inline constexpr bool kPassable =
    !std::is_rvalue_reference_v<A> &&
    !(std::is_lvalue_reference_v<A> && !std::is_const_v<std::remove_reference_t<A>>);

}  // namespace unit_module_internal

template <typename M, typename R, typename... A>
class UnitModuleOf<M, R (M::*)(A...)> : public UnitModuleImpl {
  static_assert((unit_module_internal::kPassable<A> && ...),
                "fsdp::UnitModule: the held forward takes a parameter by non-const or rvalue "
                "reference; it gets copies of its arguments, so what it writes there or takes "
                "over would be lost");

 public:
  explicit UnitModuleOf(std::shared_ptr<M> inner) : UnitModuleImpl(inner), held_(std::move(inner)) {}

  R forward(A... args) {
    return ScopedForward([m = held_](auto&... a) -> R { return m->forward(a...); },
                         std::forward<A>(args)...);
  }

 private:
  std::shared_ptr<M> held_;
};

// A const forward: the same.
template <typename M, typename R, typename... A>
class UnitModuleOf<M, R (M::*)(A...) const> : public UnitModuleOf<M, R (M::*)(A...)> {
 public:
  using UnitModuleOf<M, R (M::*)(A...)>::UnitModuleOf;
};

namespace unit_module_internal {

template <typename M, bool = ForwardSignature<M>::kKnown>
struct ImplOf {
  using Type = UnitModuleOf<M>;
};
template <typename M>
struct ImplOf<M, true> {
  using Type = UnitModuleOf<M, typename ForwardSignature<M>::Type>;
};

}  // namespace unit_module_internal

template <typename M>
using UnitModuleImplOf = typename unit_module_internal::ImplOf<M>::Type;

// The holder, as torch::nn::Linear is LinearImpl's.
template <typename M>
class UnitModule : public torch::nn::ModuleHolder<UnitModuleImplOf<M>> {
  using Holder = torch::nn::ModuleHolder<UnitModuleImplOf<M>>;

 public:
  UnitModule(std::nullptr_t) : Holder(nullptr) {}  // NOLINT: an empty holder, as libtorch's.
  explicit UnitModule(const torch::nn::ModuleHolder<M>& inner)
      : Holder(std::make_shared<UnitModuleImplOf<M>>(inner.ptr())) {}
  explicit UnitModule(std::shared_ptr<M> inner)
      : Holder(std::make_shared<UnitModuleImplOf<M>>(std::move(inner))) {}
  // As libtorch's holders: what register_module returns is assigned back.
  UnitModule(std::shared_ptr<UnitModuleImplOf<M>> module)  // NOLINT
      : Holder(std::move(module)) {}
};

template <typename M>
UnitModule(const torch::nn::ModuleHolder<M>&) -> UnitModule<M>;
template <typename M>
UnitModule(std::shared_ptr<M>) -> UnitModule<M>;

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_MODULE_H_
