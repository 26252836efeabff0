// Fixtures shared by the fsdp tests: deterministic parameters and batches
// (so rank threads build identical models without sharing a generator) and
// the optimizers the parity tests train with.
#ifndef FSDP_FSDP_TEST_UTIL_H_
#define FSDP_FSDP_TEST_UTIL_H_

#include <memory>
#include <vector>

#include "ATen/ATen.h"
#include "torch/nn/module.h"
#include "torch/optim/adam.h"
#include "torch/optim/optimizer.h"
#include "torch/optim/sgd.h"

namespace fsdp::testing {

// Divisible by every world size the tests use (1, 2, 3, 4).
inline constexpr int kGlobalBatch = 12;

// Sets every parameter from a formula of its position and index.
inline void FillDeterministically(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : module.parameters()) {
    ++k;
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat) * (0.7 + 0.1 * k) + k).view(p.sizes()) *
            0.4);
  }
}

// The global batch of a step (and micro-batch): [kGlobalBatch, 7] inputs and
// [kGlobalBatch, 5] regression targets.
inline at::Tensor Inputs(int step, int micro) {
  return at::sin(at::arange(kGlobalBatch * 7, at::kFloat) * 0.37 + step + 0.5 * micro)
      .view({kGlobalBatch, 7});
}
inline at::Tensor Targets(int step, int micro) {
  return at::cos(at::arange(kGlobalBatch * 5, at::kFloat) * 0.21 - step + 0.3 * micro)
      .view({kGlobalBatch, 5});
}

enum class Optim { kSgdMomentum, kAdam };

inline std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Optim kind,
                                                              std::vector<at::Tensor> params) {
  if (kind == Optim::kSgdMomentum) {
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
}

}  // namespace fsdp::testing

#endif  // FSDP_FSDP_TEST_UTIL_H_
