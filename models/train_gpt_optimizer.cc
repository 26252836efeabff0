#include "models/train_gpt_optimizer.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "models/train_gpt_flags.h"
#include "optim/flat_shard_optimizers.h"
#include "torch/optim/adamw.h"
#include "torch/optim/sgd.h"

namespace train_gpt {
namespace {

// One optimizer hyper-parameter: its flag, and its value in a group.
struct Hyperparameter {
  const char* name;
  std::optional<double> flag;
  double fresh_default;
  double current;
  std::function<void(double)> set;
};

// Whether parameter group `g` is decayed: all are, but nanoGPT's second.
bool GroupDecays(size_t g) {
  return !(absl::GetFlag(FLAGS_weight_decay_groups) == "nanogpt" && g == 1);
}

// The hyper-parameters of group `g` (a group without decay has no weight
// decay to set: it stays 0).
std::vector<Hyperparameter> HyperparametersOf(torch::optim::OptimizerOptions& options, size_t g) {
  std::vector<Hyperparameter> all;
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    all = {{"lr", absl::GetFlag(FLAGS_lr), 3e-3, o->lr(), [o](double v) { o->lr(v); }},
           {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0.01, o->weight_decay(),
            [o](double v) { o->weight_decay(v); }},
           {"beta1", absl::GetFlag(FLAGS_beta1), 0.9, std::get<0>(o->betas()),
            [o](double v) { o->betas(std::make_tuple(v, std::get<1>(o->betas()))); }},
           {"beta2", absl::GetFlag(FLAGS_beta2), 0.99, std::get<1>(o->betas()),
            [o](double v) { o->betas(std::make_tuple(std::get<0>(o->betas()), v)); }},
           {"eps", absl::GetFlag(FLAGS_eps), 1e-8, o->eps(), [o](double v) { o->eps(v); }}};
  } else {
    auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options);
    TORCH_CHECK(sgd != nullptr, "train_gpt: an optimizer of neither AdamW nor SGD");
    all = {{"lr", absl::GetFlag(FLAGS_lr), 3e-3, sgd->lr(), [sgd](double v) { sgd->lr(v); }},
           {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0.01, sgd->weight_decay(),
            [sgd](double v) { sgd->weight_decay(v); }},
           {"beta1", absl::GetFlag(FLAGS_beta1), 0.9, sgd->momentum(),
            [sgd](double v) { sgd->momentum(v); }}};
  }
  if (!GroupDecays(g)) {
    all.erase(std::remove_if(
                  all.begin(), all.end(),
                  [](const Hyperparameter& h) { return std::string(h.name) == "weight_decay"; }),
              all.end());
  }
  return all;
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const std::vector<std::vector<at::Tensor>>& groups) {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  const std::string kernel = absl::GetFlag(FLAGS_optimizer_kernel);
  const fsdp::FlatShardKernel flat_kernel =
      kernel == "flat_fused" ? fsdp::FlatShardKernel::kFused : fsdp::FlatShardKernel::kExact;
  if (absl::GetFlag(FLAGS_optimizer) == "sgd") {
    const auto options = torch::optim::SGDOptions(3e-3);
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (const auto& params : groups) {
      param_groups.emplace_back(params, std::make_unique<torch::optim::SGDOptions>(options));
    }
    if (kernel == "per_parameter") {
      optimizer = std::make_unique<torch::optim::SGD>(std::move(param_groups), options);
    } else {
      optimizer =
          std::make_unique<fsdp::FlatShardSGD>(std::move(param_groups), options, flat_kernel);
    }
  } else {
    const auto options = torch::optim::AdamWOptions(3e-3);
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (const auto& params : groups) {
      param_groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(options));
    }
    if (kernel == "per_parameter") {
      optimizer = std::make_unique<torch::optim::AdamW>(std::move(param_groups), options);
    } else {
      optimizer =
          std::make_unique<fsdp::FlatShardAdamW>(std::move(param_groups), options, flat_kernel);
    }
  }
  for (size_t g = 0; g < optimizer->param_groups().size(); ++g) {
    auto& options = optimizer->param_groups()[g].options();
    for (const Hyperparameter& h : HyperparametersOf(options, g)) {
      h.set(h.flag.value_or(h.fresh_default));
    }
    if (!GroupDecays(g)) {
      if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) o->weight_decay(0);
      if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) o->weight_decay(0);
    }
  }
  return optimizer;
}

std::string ApplyGivenHyperparameters(torch::optim::Optimizer& optimizer) {
  std::vector<std::string> described;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const Hyperparameter& h : HyperparametersOf(optimizer.param_groups()[g].options(), g)) {
      if (h.flag.has_value() && *h.flag != h.current) {
        h.set(*h.flag);
        if (g == 0) {
          described.push_back(absl::StrFormat("%s %g (--%s; the checkpoint's was %g)", h.name,
                                              *h.flag, h.name, h.current));
        }
      } else if (g == 0) {
        described.push_back(absl::StrFormat("%s %g (the checkpoint's)", h.name, h.current));
      }
    }
  }
  return absl::StrJoin(described, ", ");
}

}  // namespace train_gpt
