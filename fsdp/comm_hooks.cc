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
  Collectives* replicate = context.replicate_group;
  const int world =
      context.group.world_size() * (replicate != nullptr ? replicate->world_size() : 1);
  const double predivide = GradientPredivideFactor(world);
  const double postdivide = world / predivide;
  if (predivide != 1) grad.div_(predivide);
  if (context.sharded) {
    context.group.ReduceScatterTensor(out, grad, ReduceOp::kSum)->Wait();
  } else {
    context.group.AllReduce(grad, ReduceOp::kSum)->Wait();
  }
  if (replicate != nullptr && replicate->world_size() > 1) {
    // Only this rank's shard crosses shard groups.
    replicate->AllReduce(out, ReduceOp::kSum)->Wait();
  }
  if (postdivide != 1) out.div_(postdivide);
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
