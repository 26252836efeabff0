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

void DefaultCommHook::Reduce(const CommHookContext& context, at::Tensor& grad, at::Tensor& out) {
  const int world = context.group.world_size();
  const double predivide = GradientPredivideFactor(world);
  if (predivide != 1) grad.div_(predivide);
  if (context.sharded) {
    context.group.ReduceScatterTensor(out, grad, ReduceOp::kSum)->Wait();
  } else {
    context.group.AllReduce(grad, ReduceOp::kSum)->Wait();
  }
  if (world / predivide != 1) out.div_(world / predivide);
}

std::string LowPrecisionCommHook::Name() const {
  return absl::StrCat(DTypeName(dtype_), "_compress");
}

void LowPrecisionCommHook::Reduce(const CommHookContext& context, at::Tensor& grad,
                                  at::Tensor& out) {
  at::Tensor low = grad.to(ToScalarType(dtype_));
  at::Tensor low_out = context.sharded ? at::empty({out.numel()}, low.options()) : low;
  DefaultCommHook().Reduce(context, low, low_out);
  out.copy_(low_out);
}

}  // namespace fsdp
