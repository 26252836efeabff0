#include "fsdp/comm_hooks.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "fsdp/fsdp_options.h"

namespace fsdp {

double GradientPredivideFactor(int world_size) {
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return factor;
}

namespace {

class Completed : public PendingReduction {
 public:
  void Wait() override {}
};

class Then : public PendingReduction {
 public:
  Then(std::unique_ptr<PendingReduction> first, std::function<void()> then)
      : then_(std::move(then)), first_(std::move(first)) {}

  void Advance() override { first_->Advance(); }
  void Wait() override {
    first_->Wait();
    first_.reset();
    std::function<void()> then = std::move(then_);
    then_ = nullptr;
    then();
  }

 private:
  std::function<void()> then_;  // Its tensors outlive `first_`'s wait.
  std::unique_ptr<PendingReduction> first_;
};

// The built-in reduction in flight: the group's collective, then the
// post-divide.
class DefaultReduction : public PendingReduction {
 public:
  DefaultReduction(std::unique_ptr<CollectiveWork> work, at::Tensor grad, at::Tensor out,
                   double postdivide)
      : grad_(std::move(grad)),
        out_(std::move(out)),
        postdivide_(postdivide),
        work_(std::move(work)) {}

  void Advance() override {
    if (work_ == nullptr) return;
    work_->Wait();
    work_.reset();
    grad_ = at::Tensor();  // The flat gradient is no longer read.
  }

  void Wait() override {
    Advance();
    if (postdivide_ != 1) out_.div_(postdivide_);
    out_ = at::Tensor();
  }

 private:
  // Declared before the work, so that a destroyed reduction waits for it
  // before it lets go of its tensors.
  at::Tensor grad_;
  at::Tensor out_;
  const double postdivide_;
  std::unique_ptr<CollectiveWork> work_;
};

}  // namespace

std::unique_ptr<PendingReduction> CompletedReduction() { return std::make_unique<Completed>(); }

std::unique_ptr<PendingReduction> ReductionThen(std::unique_ptr<PendingReduction> first,
                                                std::function<void()> then) {
  return std::make_unique<Then>(std::move(first), std::move(then));
}

GradientDivisors GradientDivisorsFor(int world_size, std::optional<double> divide_factor) {
  // FSDP2 divides by a user's factor wholly before the sum.
  if (divide_factor) return {*divide_factor, 1};
  const double pre = GradientPredivideFactor(world_size);
  return {pre, world_size / pre};
}

std::unique_ptr<PendingReduction> DefaultCommHook::Reduce(const CommHookContext& context,
                                                          at::Tensor grad, at::Tensor out) {
  const GradientDivisors divisors =
      GradientDivisorsFor(context.group.world_size(), context.divide_factor);
  if (divisors.pre != 1) grad.div_(divisors.pre);
  std::unique_ptr<CollectiveWork> work =
      context.sharded ? context.group.ReduceScatterTensor(out, grad, ReduceOp::kSum)
                      : context.group.AllReduce(grad, ReduceOp::kSum);
  return std::make_unique<DefaultReduction>(std::move(work), std::move(grad), std::move(out),
                                            divisors.post);
}

LowPrecisionCommHook::LowPrecisionCommHook(at::ScalarType dtype) : dtype_(dtype) {
  TORCH_CHECK(IsMixedPrecisionDtype(dtype), "LowPrecisionCommHook: ", DtypeFlagName(dtype),
              " is not one of float32, float16, bfloat16");
}

std::string LowPrecisionCommHook::Name() const {
  return absl::StrCat(DtypeFlagName(dtype_), "_compress");
}

std::unique_ptr<PendingReduction> LowPrecisionCommHook::Reduce(const CommHookContext& context,
                                                               at::Tensor grad, at::Tensor out) {
  at::Tensor low = grad.to(dtype_);
  at::Tensor low_out = context.sharded ? at::empty({out.numel()}, low.options()) : low;
  return ReductionThen(DefaultCommHook().Reduce(context, low, low_out),
                       [out, low_out]() mutable { out.copy_(low_out); });
}

}  // namespace fsdp
