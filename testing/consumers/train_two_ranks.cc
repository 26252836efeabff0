// A program outside this repository's build, as a user writes one: the GPT
// wrapped with FULL_SHARD (one unit per block) on two ranks, run as threads
// over Gloo, trained for a few steps on one fixed batch. It includes only the
// public headers and links only what the installed CMake package
// (fsdp_cpp::) or the Bazel aliases (@fsdp_cpp//:...) export; the consumer
// tests (tools/test_consumers.sh) build it both ways and run it. Exits 0 when
// both ranks saw the same, falling loss.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "comm/gloo_collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/utilities.h"
#include "models/gpt.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"
#include "torch/optim/adamw.h"

namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 6;

// Trains on rank `rank`; returns the losses, or an error message.
std::string TrainRank(c10::intrusive_ptr<c10d::Store> store, int rank,
                      std::vector<double>& losses) {
  fsdp::GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  auto group = fsdp::CreateGlooCollectives(store, rank, kWorld, gloo);
  if (!group.ok()) return std::string(group.status().message());
  models::GptConfig config;
  config.block_size = 16;
  config.seed = 1;
  models::Gpt model(config);
  auto wrapped = fsdp::FullyShardedModel::Wrap(
      model.ptr(), **group, fsdp::FsdpOptions{fsdp::ShardingStrategy::kFullShard},
      fsdp::SelectModulesOfType<models::BlockImpl>());
  if (!wrapped.ok()) return std::string(wrapped.status().message());
  // Each tensor once: lm_head.weight is wte's, and parameters() lists it twice.
  torch::optim::AdamW optimizer(fsdp::UniqueParameters(*model),
                                torch::optim::AdamWOptions(1e-2));
  // Each rank its own half of the global batch, from a generator of its own:
  // the ranks are threads, and the global one would make the batch depend on
  // their interleaving.
  at::Generator generator = at::detail::createCPUGenerator(7 + rank);
  const at::Tensor tokens =
      at::randint(0, config.vocab_size, {4, config.block_size + 1}, generator);
  const at::Tensor input = tokens.narrow(1, 0, config.block_size);
  const at::Tensor target = tokens.narrow(1, 1, config.block_size);
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = models::LanguageModelLoss(model->forward(input), target);
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    // The global loss: every rank must report the same number.
    at::Tensor global = loss.detach().clone();
    (*group)->AllReduce(global, fsdp::ReduceOp::kAvg)->Wait();
    losses.push_back(global.item<double>());
  }
  return "";
}

}  // namespace

int main() {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(kWorld);
  std::vector<std::vector<double>> losses(kWorld);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] { errors[rank] = TrainRank(store, rank, losses[rank]); });
  }
  for (std::thread& t : ranks) t.join();
  for (int rank = 0; rank < kWorld; ++rank) {
    if (!errors[rank].empty()) {
      std::fprintf(stderr, "consumer: rank %d failed: %s\n", rank, errors[rank].c_str());
      return 1;
    }
  }
  if (losses[0] != losses[1]) {
    std::fprintf(stderr, "consumer: the ranks disagree on the loss\n");
    return 1;
  }
  std::printf("consumer: FULL_SHARD on %d ranks, loss %.4f -> %.4f in %d steps\n", kWorld,
              losses[0].front(), losses[0].back(), kSteps);
  return losses[0].back() < losses[0].front() ? 0 : 1;
}
