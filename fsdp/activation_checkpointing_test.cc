#include "fsdp/activation_checkpointing.h"

#include <memory>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/CPUGeneratorImpl.h"
#include "ATen/Context.h"
#include "ATen/autocast_mode.h"
#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_forward.h"
#include "fsdp/utilities.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"
#include "torch/version.h"

namespace fsdp {
namespace {

using ::fsdp::testing::FillDeterministically;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::kGlobalBatch;
using ::fsdp::testing::RunOnThreadRanks;
using ::fsdp::testing::Targets;
using ::testing::HasSubstr;

// A block that may be a unit and may be checkpointed: two linears, GELU,
// dropout from a generator of its own (thread ranks share the default
// one), a residual when the widths agree. Counts its body's runs.
struct CkBlockImpl : torch::nn::Module, ShardableModule, CheckpointableModule {
  CkBlockImpl(int64_t in, int64_t out, double dropout, uint64_t seed)
      : dropout(dropout), generator(at::detail::createCPUGenerator(seed)) {
    fc1 = register_module("fc1", torch::nn::Linear(in, 3 * out));
    fc2 = register_module("fc2", torch::nn::Linear(3 * out, out));
    residual = in == out;
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    return unit.Return(CheckpointedForward(*this, x, [this](const at::Tensor& x) {
      ++body_runs;
      at::Tensor h = at::gelu(fc1->forward(x));
      if (dropout > 0 && is_training()) {
        at::Tensor keep = at::empty_like(h).bernoulli_(1 - dropout, generator);
        h = h * keep / (1 - dropout);
      }
      at::Tensor y = fc2->forward(h);
      return residual ? x + y : y;
    }));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool residual;
  double dropout;
  at::Generator generator;
  int body_runs = 0;
};
TORCH_MODULE(CkBlock);

struct CkNetImpl : torch::nn::Module, ShardableModule {
  explicit CkNetImpl(double dropout = 0.0) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(CkBlock(7, 11, dropout, 1));
    blocks->push_back(CkBlock(11, 11, dropout, 2));
    blocks->push_back(CkBlock(11, 11, dropout, 3));
    head = register_module("head", torch::nn::Linear(11, 5));
    FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    for (const auto& block : *blocks) x = block->as<CkBlockImpl>()->forward(x);
    return unit.Return(head->forward(x));
  }
  CkBlockImpl& block(int i) { return *blocks[i]->as<CkBlockImpl>(); }
  std::vector<at::Generator> generators() {
    std::vector<at::Generator> out;
    for (int i = 0; i < 3; ++i) out.push_back(block(i).generator);
    return out;
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(CkNet);

absl::Status CheckpointBlocks(CkNetImpl& net) {
  CheckpointOptions options;
  options.generators = net.generators();
  absl::StatusOr<std::vector<std::string>> chosen =
      ApplyActivationCheckpointing(net, *ModuleTypePolicy::Of<CkBlockImpl>(), options);
  if (!chosen.ok()) return chosen.status();
  EXPECT_EQ(*chosen, (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2"}));
  return absl::OkStatus();
}

// One forward and backward of `net` on step 0's batch; the loss.
at::Tensor ForwardBackward(CkNetImpl& net, const at::Tensor& input) {
  at::Tensor loss = at::mse_loss(net.forward(input), Targets(0, 0).narrow(0, 0, input.size(0)));
  loss.backward();
  return loss;
}

void ExpectSameGradients(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].value().grad().defined()) << pa[i].key();
    EXPECT_TRUE(at::equal(pa[i].value().grad(), pb[i].value().grad())) << pa[i].key();
  }
}

TEST(ActivationCheckpointing, GradientsEqualThoseWithoutBitForBit) {
  CkNet plain, checkpointed;
  ASSERT_TRUE(CheckpointBlocks(*checkpointed).ok());
  at::Tensor x = Inputs(0, 0).requires_grad_(true);
  at::Tensor x2 = Inputs(0, 0).requires_grad_(true);
  EXPECT_EQ(CheckpointedRegionsInGraph(checkpointed->forward(x2)), 3);
  EXPECT_EQ(CheckpointedRegionsInGraph(plain->forward(x)), 0);
  for (int i = 0; i < 3; ++i) plain->block(i).body_runs = checkpointed->block(i).body_runs = 0;
  at::Tensor loss = ForwardBackward(*plain, x);
  at::Tensor loss2 = ForwardBackward(*checkpointed, x2);
  EXPECT_TRUE(at::equal(loss, loss2));
  ExpectSameGradients(*plain, *checkpointed);
  EXPECT_TRUE(at::equal(x.grad(), x2.grad()));
  // Forward once, recompute once.
  EXPECT_EQ(plain->block(1).body_runs, 1);
  EXPECT_EQ(checkpointed->block(1).body_runs, 2);
}

TEST(ActivationCheckpointing, DropoutRecomputesTheSameMaskAndLeavesTheGeneratorsAsWithout) {
  CkNet plain(0.3), checkpointed(0.3);
  ASSERT_TRUE(CheckpointBlocks(*checkpointed).ok());
  ForwardBackward(*plain, Inputs(0, 0));
  ForwardBackward(*checkpointed, Inputs(0, 0));
  ExpectSameGradients(*plain, *checkpointed);
  // The next draws are those the run without checkpointing makes.
  for (int i = 0; i < 3; ++i) {
    at::Tensor a = at::empty({4}).uniform_(0, 1, plain->block(i).generator);
    at::Tensor b = at::empty({4}).uniform_(0, 1, checkpointed->block(i).generator);
    EXPECT_TRUE(at::equal(a, b)) << "block " << i;
  }
}

TEST(ActivationCheckpointing, TheDefaultGeneratorIsRestoredForTheRecompute) {
  auto linear = torch::nn::Linear(6, 6);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::dropout(linear->forward(in[0]), 0.5, /*train=*/true)};
  };
  auto run = [&](bool checkpoint) {
    linear->zero_grad();
    at::manual_seed(7);
    at::Tensor x = at::ones({3, 6});
    at::Tensor y =
        checkpoint ? Checkpoint("dropout", body, {x}, linear->parameters())[0] : body({x})[0];
    y.pow(2).sum().backward();
    return std::make_pair(linear->weight.grad().clone(), at::rand({3}));
  };
  auto [grad_plain, next_plain] = run(false);
  auto [grad_checkpointed, next_checkpointed] = run(true);
  EXPECT_TRUE(at::equal(grad_plain, grad_checkpointed));
  EXPECT_TRUE(at::equal(next_plain, next_checkpointed));
}

TEST(ActivationCheckpointing, ParametersTrainWhenNoInputRequiresGrad) {
  CkNet plain, checkpointed;
  ASSERT_TRUE(CheckpointBlocks(*checkpointed).ok());
  ForwardBackward(*plain, Inputs(0, 0));  // The input does not require grad.
  ForwardBackward(*checkpointed, Inputs(0, 0));
  ExpectSameGradients(*plain, *checkpointed);
  EXPECT_EQ(checkpointed->block(0).body_runs, 2);  // Recomputed, so checkpointed.
}

TEST(ActivationCheckpointing, OutputsUsedTwiceAndUnusedOutputs) {
  auto linear = torch::nn::Linear(4, 4);
  auto body = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = linear->forward(in[0]);
    return std::vector<at::Tensor>{at::tanh(h), h * 2, in[1].argmax(-1)};
  };
  auto run = [&](bool checkpoint) {
    linear->zero_grad();
    at::Tensor x = at::sin(at::arange(8, at::kFloat)).view({2, 4}).requires_grad_(true);
    at::Tensor z = at::cos(at::arange(8, at::kFloat)).view({2, 4});
    std::vector<at::Tensor> out =
        checkpoint ? Checkpoint("two", body, {x, z}, linear->parameters()) : body({x, z});
    EXPECT_FALSE(out[2].requires_grad());
    // out[1] takes no part in the loss; out[0] takes part twice.
    (out[0].sum() + (out[0] * out[0]).sum()).backward();
    return std::make_pair(linear->weight.grad().clone(), x.grad().clone());
  };
  auto [w_plain, x_plain] = run(false);
  auto [w_checkpointed, x_checkpointed] = run(true);
  EXPECT_TRUE(at::equal(w_plain, w_checkpointed));
  EXPECT_TRUE(at::equal(x_plain, x_checkpointed));
}

TEST(ActivationCheckpointing, UnderNoGradTheBodyRunsOnceAndNothingIsRecorded) {
  CkNet net;
  ASSERT_TRUE(CheckpointBlocks(*net).ok());
  at::NoGradGuard no_grad;
  at::Tensor out = net->forward(Inputs(0, 0));
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(net->block(0).body_runs, 1);
}

TEST(ActivationCheckpointing, AutogradGradOverTheModelSeesTheParameters) {
  CkNet plain, checkpointed;
  ASSERT_TRUE(CheckpointBlocks(*checkpointed).ok());
  auto grads = [](CkNetImpl& net) {
    at::Tensor loss = at::mse_loss(net.forward(Inputs(0, 0)), Targets(0, 0));
    std::vector<at::Tensor> params = net.parameters();
    return torch::autograd::grad({loss}, params);
  };
  std::vector<at::Tensor> a = grads(*plain), b = grads(*checkpointed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  // grad() accumulates nothing.
  for (const at::Tensor& p : checkpointed->parameters()) EXPECT_FALSE(p.grad().defined());
}

// A module reached twice (a shared Linear) delivers its gradient once.
TEST(ActivationCheckpointing, ASharedModuleGetsItsGradientOnce) {
  auto shared = torch::nn::Linear(4, 4);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{shared->forward(at::tanh(shared->forward(in[0])))};
  };
  std::vector<at::Tensor> twice = shared->parameters();
  for (const at::Tensor& p : shared->parameters()) twice.push_back(p);
  auto run = [&](bool checkpoint) {
    shared->zero_grad();
    at::Tensor x = at::sin(at::arange(8, at::kFloat)).view({2, 4});
    at::Tensor y = checkpoint ? Checkpoint("shared", body, {x}, twice)[0] : body({x})[0];
    y.pow(2).sum().backward();
    return shared->weight.grad().clone();
  };
  at::Tensor plain = run(false);
  EXPECT_TRUE(at::equal(plain, run(true)));
}

// Autocast is on for the recompute as in forward, and leaves no cached
// low-precision weight behind: a forward after the weights change uses
// the new ones.
void SetCpuAutocast(bool on) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(at::kCPU, on);
#else
  at::autocast::set_cpu_enabled(on);
#endif
  if (!on) at::autocast::clear_cache();  // What an autocast scope does on exit.
}

TEST(ActivationCheckpointing, AutocastIsRestoredForTheRecomputeWithoutCachingCasts) {
  auto set_cpu_autocast = SetCpuAutocast;
  auto linear = torch::nn::Linear(8, 8);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{linear->forward(in[0])};
  };
  const at::Tensor x = at::sin(at::arange(16, at::kFloat)).view({2, 8});
  auto grads = [&](bool checkpoint) {
    linear->zero_grad();
    set_cpu_autocast(true);
    at::Tensor y =
        checkpoint ? Checkpoint("autocast", body, {x}, linear->parameters())[0] : body({x})[0];
    set_cpu_autocast(false);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.to(at::kFloat).pow(2).sum().backward();
    return linear->weight.grad().clone();
  };
  at::Tensor plain = grads(false);
  EXPECT_TRUE(at::equal(plain, grads(true)));
  {
    at::NoGradGuard no_grad;
    linear->weight.add_(1.0);
  }
  set_cpu_autocast(true);
  at::Tensor after = linear->forward(x);
  set_cpu_autocast(false);
  at::Tensor want = at::linear(x.to(at::kBFloat16), linear->weight.to(at::kBFloat16),
                               linear->bias.to(at::kBFloat16));
  EXPECT_TRUE(at::equal(after, want)) << "a stale cached cast of the weight was used";
}

// A plain use of a weight after a checkpointed one, in one autocast scope:
// the region's forward runs with gradients off, and a low-precision copy of
// the weight cached there would have no history, so the plain use would
// take it and its share of the weight's gradient would be lost (PyTorch
// issue 112583). The region turns the cache off; libtorch 1.13 and 2.15 do
// not show the loss with it on either, so this guards other versions.
TEST(ActivationCheckpointing, AWeightUsedAgainAfterItsRegionInOneAutocastScopeGetsBothGradients) {
  auto linear = torch::nn::Linear(8, 8);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{linear->forward(in[0])};
  };
  const at::Tensor x = at::sin(at::arange(16, at::kFloat)).view({2, 8});
  auto grads = [&](bool checkpoint) {
    linear->zero_grad();
    SetCpuAutocast(true);
    at::Tensor y =
        checkpoint ? Checkpoint("autocast", body, {x}, linear->parameters())[0] : body({x})[0];
    at::Tensor z = linear->forward(x);
    SetCpuAutocast(false);
    (y.to(at::kFloat).sum() + z.to(at::kFloat).pow(2).sum()).backward();
    return linear->weight.grad().clone();
  };
  const at::Tensor plain = grads(false);
  // Not bit for bit: without checkpointing both uses share one cast, whose
  // gradient sums them in bfloat16; with it each use's is cast on its own.
  EXPECT_TRUE(at::allclose(grads(true), plain, 2e-2, 2e-2))
      << "the plain use's gradient was lost: " << (grads(true) - plain).abs().max();
}

TEST(ActivationCheckpointing, RefusesSecondOrderGradientsAndUndefinedTensors) {
  auto linear = torch::nn::Linear(4, 4);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::tanh(linear->forward(in[0]))};
  };
  at::Tensor x = at::ones({2, 4}).requires_grad_(true);
  at::Tensor y = Checkpoint("twice", body, {x}, linear->parameters())[0];
  try {
    torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("region 'twice' cannot be differentiated twice"));
  }
  try {
    Checkpoint("undefined", body, {x, at::Tensor()}, linear->parameters());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("input 1 of region 'undefined' is an undefined tensor"));
  }
  auto returns_undefined = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{linear->forward(in[0]), at::Tensor()};
  };
  try {
    Checkpoint("undefined output", returns_undefined, {x}, linear->parameters());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("returned an undefined tensor as output 1"));
  }
}

// On a GPU, fused attention with dropout: the recompute (with autograd)
// must draw the mask the forward (without) drew, although the kernel could
// pick its algorithm by whether inputs require grad. Runs where libtorch
// has scaled_dot_product_attention and a GPU is visible (tools/gpu_verify.sh).
TEST(ActivationCheckpointing, CudaAttentionDropoutRecomputesTheSameMask) {
#if TORCH_VERSION_MAJOR >= 2
  if (at::getNumGPUs() == 0) GTEST_SKIP() << "no GPU visible";
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto qkv = torch::nn::Linear(32, 96);
    qkv->to(at::Device(at::kCUDA, 0), dtype);
    auto body = [&](const std::vector<at::Tensor>& in) {
      at::Tensor h = qkv->forward(in[0]).view({2, 64, 3, 2, 16}).permute({2, 0, 3, 1, 4});
      return std::vector<at::Tensor>{at::scaled_dot_product_attention(
          h[0], h[1], h[2], /*attn_mask=*/{}, /*dropout_p=*/0.3, /*is_causal=*/true)};
    };
    auto run = [&](bool checkpoint) {
      qkv->zero_grad();
      at::manual_seed(11);
      at::Tensor x = at::sin(at::arange(2 * 64 * 32, at::kFloat))
                         .view({2, 64, 32})
                         .to(at::Device(at::kCUDA, 0), dtype);
      at::Tensor y =
          checkpoint ? Checkpoint("sdpa", body, {x}, qkv->parameters())[0] : body({x})[0];
      y.to(at::kFloat).pow(2).sum().backward();
      return qkv->weight.grad().cpu();
    };
    at::Tensor plain = run(false);
    EXPECT_TRUE(at::equal(plain, run(true))) << at::toString(dtype);
  }
#else
  GTEST_SKIP() << "libtorch 1.x has no scaled_dot_product_attention";
#endif
}

TEST(ActivationCheckpointing, RefusesATensorRequiringGradThatIsNeitherInputNorParameter) {
  auto linear = torch::nn::Linear(4, 4);
  at::Tensor captured = at::ones({4}, at::kFloat).requires_grad_(true);
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{linear->forward(in[0]) * captured};
  };
  at::Tensor y = Checkpoint("captures", body, {at::ones({2, 4})}, linear->parameters())[0];
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("region 'captures' uses a tensor that requires grad"));
    EXPECT_THAT(e.what(), HasSubstr("neither one of its inputs nor one of its parameters"));
  }
}

TEST(ActivationCheckpointing, ModifyingASavedInputInPlaceIsAnError) {
  auto linear = torch::nn::Linear(4, 4);
  at::Tensor x = at::ones({2, 4}).requires_grad_(true);
  at::Tensor input = x * 1;
  auto body = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{linear->forward(in[0])};
  };
  at::Tensor y = Checkpoint("inplace", body, {input}, linear->parameters())[0];
  {
    at::NoGradGuard no_grad;
    input.add_(1);
  }
  EXPECT_THROW(y.sum().backward(), c10::Error);
}

TEST(ApplyActivationCheckpointing, RefusesAModuleWithoutARegion) {
  CkNet net;
  absl::Status status =
      ApplyActivationCheckpointing(*net, *ModuleTypePolicy::Of<torch::nn::LinearImpl>()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("is not an fsdp::CheckpointableModule"));
  EXPECT_FALSE(net->block(0).activation_checkpointing());  // Nothing changed.
}

struct OuterImpl : torch::nn::Module, CheckpointableModule {
  OuterImpl() { inner = register_module("inner", CkBlock(4, 4, 0.0, 0)); }
  CkBlock inner{nullptr};
};
TORCH_MODULE(Outer);

TEST(ApplyActivationCheckpointing, RefusesNestedAndRepeatedCheckpointing) {
  Outer outer;
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("outer", outer);
  const LambdaPolicy both([](const std::string&, const torch::nn::Module& m) {
    return dynamic_cast<const CheckpointableModule*>(&m) != nullptr;
  });
  absl::Status status = ApplyActivationCheckpointing(*root, both).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("'outer.inner' is inside 'outer', which is checkpointed too"));
  EXPECT_FALSE(outer->activation_checkpointing());
  EXPECT_FALSE(outer->inner->activation_checkpointing());

  ASSERT_TRUE(ApplyActivationCheckpointing(*root, *ModuleTypePolicy::Of<CkBlockImpl>()).ok());
  status = ApplyActivationCheckpointing(*root, *ModuleTypePolicy::Of<CkBlockImpl>()).status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("'outer.inner' is already checkpointed"));
  status = ApplyActivationCheckpointing(*root, *ModuleTypePolicy::Of<OuterImpl>()).status();
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("'outer' contains 'outer.inner', which is checkpointed already"));
  ASSERT_TRUE(RemoveActivationCheckpointing(*root).ok());
  EXPECT_FALSE(outer->inner->activation_checkpointing());
  EXPECT_TRUE(ApplyActivationCheckpointing(*root, *ModuleTypePolicy::Of<OuterImpl>()).ok());
  // A policy that chooses nothing (here: the checkpointed type's holder
  // name misspelt as another type) is an error, not a silent no-op.
  ASSERT_TRUE(RemoveActivationCheckpointing(*root).ok());
  status = ApplyActivationCheckpointing(*root, *ModuleTypePolicy::Of<torch::nn::ModuleListImpl>())
               .status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("chose no module of the model"));
}

// Under FSDP, at W = 1, 2, 3 and every strategy, with dropout: training with
// checkpointing equals training without, bit for bit, with the same
// collectives.
struct FsdpCase {
  int world_size;
  ShardingStrategy strategy;
  // Forward prefetch, backward_post prefetch and no rate limit, instead of
  // the defaults (backward_pre, limited).
  bool other_prefetch = false;
};

class ActivationCheckpointingUnderFsdp : public ::testing::TestWithParam<FsdpCase> {};

TEST_P(ActivationCheckpointingUnderFsdp, TrainsBitForBitWithTheSameCollectives) {
  const FsdpCase c = GetParam();
  absl::Status status = RunOnThreadRanks(c.world_size, [&](Collectives& comm) {
    struct Run {
      std::vector<at::Tensor> losses;
      std::vector<at::Tensor> shards;
      std::vector<CollectiveCounters> counters;
    };
    auto train = [&](bool checkpoint) {
      CkNet net(0.2);
      FsdpOptions options;
      options.strategy = c.strategy;
      if (c.other_prefetch) {
        options.forward_prefetch = true;
        options.backward_prefetch = BackwardPrefetch::kBackwardPost;
        options.limit_all_gathers = false;
      }
      auto wrapped =
          FullyShardedModel::Wrap(net.ptr(), comm, options, *ModuleTypePolicy::Of<CkBlockImpl>());
      EXPECT_TRUE(wrapped.ok()) << wrapped.status();
      if (checkpoint) {
        EXPECT_TRUE(CheckpointBlocks(*net).ok());
      }
      auto optimizer = testing::MakeOptimizer(testing::Optim::kAdam, UniqueParameters(*net));
      const int64_t rows = kGlobalBatch / comm.world_size();
      Run run;
      for (int step = 0; step < 3; ++step) {
        comm.ResetCounters();
        at::Tensor x = Inputs(step, 0).narrow(0, comm.rank() * rows, rows);
        at::Tensor loss =
            at::mse_loss(net->forward(x), Targets(step, 0).narrow(0, comm.rank() * rows, rows));
        loss.backward();
        optimizer->step();
        optimizer->zero_grad();
        run.losses.push_back(loss.detach());
        run.counters.push_back(comm.counters());
      }
      for (const at::Tensor& p : UniqueParameters(*net)) run.shards.push_back(p.detach().clone());
      EXPECT_EQ(net->block(0).body_runs, checkpoint ? 6 : 3);
      return run;
    };
    const Run plain = train(false);
    const Run checkpointed = train(true);
    for (size_t i = 0; i < plain.losses.size(); ++i) {
      EXPECT_TRUE(at::equal(plain.losses[i], checkpointed.losses[i])) << "step " << i;
      for (CollectiveOp op :
           {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter, CollectiveOp::kAllReduce}) {
        EXPECT_EQ(plain.counters[i].Calls(op), checkpointed.counters[i].Calls(op))
            << "step " << i << " op " << static_cast<int>(op);
      }
    }
    if (c.strategy == ShardingStrategy::kFullShard && comm.world_size() > 1) {
      // Per step after the first: forward gathers the root and three blocks,
      // backward gathers the three blocks again (the recompute runs inside
      // the gather of the block's backward), one reduce-scatter per unit.
      EXPECT_EQ(checkpointed.counters[2].Calls(CollectiveOp::kAllGather), 4 + 3);
      EXPECT_EQ(checkpointed.counters[2].Calls(CollectiveOp::kReduceScatter), 4);
    }
    ASSERT_EQ(plain.shards.size(), checkpointed.shards.size());
    for (size_t i = 0; i < plain.shards.size(); ++i) {
      EXPECT_TRUE(at::equal(plain.shards[i], checkpointed.shards[i])) << "parameter " << i;
    }
  });
  EXPECT_TRUE(status.ok()) << status;
}

std::vector<FsdpCase> FsdpCases() {
  std::vector<FsdpCase> cases;
  for (int w : {1, 2, 3}) {
    for (ShardingStrategy s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                               ShardingStrategy::kNoShard}) {
      cases.push_back({w, s});
    }
  }
  cases.push_back({2, ShardingStrategy::kFullShard, /*other_prefetch=*/true});
  cases.push_back({3, ShardingStrategy::kShardGradOp, /*other_prefetch=*/true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, ActivationCheckpointingUnderFsdp, ::testing::ValuesIn(FsdpCases()),
                         [](const ::testing::TestParamInfo<FsdpCase>& info) {
                           return "W" + std::to_string(info.param.world_size) + "_" +
                                  ShardingStrategyName(info.param.strategy) +
                                  (info.param.other_prefetch ? "_OtherPrefetch" : "");
                         });

TEST(ActivationCheckpointingUnderFsdp, ARegionContainingAUnitIsRefusedInForward) {
  absl::Status status = RunOnThreadRanks(2, [&](Collectives& comm) {
    CkNet net;
    auto wrapped =
        FullyShardedModel::Wrap(net.ptr(), comm, {}, *ModuleTypePolicy::Of<CkBlockImpl>());
    ASSERT_TRUE(wrapped.ok()) << wrapped.status();
    auto body = [&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{net->forward(in[0])};
    };
    try {
      Checkpoint("whole model", body, {Inputs(0, 0)}, net->parameters());
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("opens its forward inside the activation-checkpointed "
                                      "region 'whole model'"));
    }
    // The model is usable afterwards.
    EXPECT_EQ((*wrapped)->training_state(), ModelTrainingState::kIdle);
    at::mse_loss(net->forward(Inputs(0, 0)), Targets(0, 0)).backward();
  });
  EXPECT_TRUE(status.ok()) << status;
}

}  // namespace
}  // namespace fsdp
