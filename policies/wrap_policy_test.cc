#include "policies/wrap_policy.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/container/sequential.h"
#include "torch/nn/modules/embedding.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// Stands in for the core's ShardableModule: the modules FSDP could hook.
struct Hookable {
  virtual ~Hookable() = default;
};

// attn: 16*16+16 = 272 elements; mlp: (16*64+64) + (64*16+16) = 2128.
struct BlockImpl : torch::nn::Module, Hookable {
  BlockImpl() {
    attn = register_module("attn", torch::nn::Linear(16, 16));
    mlp = register_module("mlp", torch::nn::Sequential(torch::nn::Linear(16, 64),
                                                        torch::nn::Linear(64, 16)));
  }
  torch::nn::Linear attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(Block);

// embed: 1600; blocks: 3 x 2400; head: 1700.
struct TreeImpl : torch::nn::Module {
  TreeImpl() {
    embed = register_module("embed", torch::nn::Embedding(100, 16));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block(), Block()));
    head = register_module("head", torch::nn::Linear(16, 100));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Tree);

PolicyInput InputFor(const torch::nn::Module& root) {
  PolicyInput input;
  input.root = &root;
  input.root_options.strategy = ShardingStrategy::kFullShard;
  return input;
}

std::vector<std::string> Fqns(const absl::StatusOr<std::vector<UnitTarget>>& targets) {
  EXPECT_TRUE(targets.ok()) << targets.status();
  std::vector<std::string> fqns;
  if (!targets.ok()) return fqns;
  for (const UnitTarget& t : *targets) fqns.push_back(t.fqn);
  return fqns;
}

TEST(ModuleTypePolicy, ByCppTypeMatchesEveryInstanceInPreOrder) {
  Tree tree;
  auto policy = ModuleTypePolicy::Of<BlockImpl>();
  EXPECT_THAT(Fqns(policy->Targets(InputFor(*tree))),
              ElementsAre("blocks.0", "blocks.1", "blocks.2"));
  auto two = ModuleTypePolicy::Of<BlockImpl, torch::nn::EmbeddingImpl>();
  EXPECT_THAT(Fqns(two->Targets(InputFor(*tree))),
              ElementsAre("embed", "blocks.0", "blocks.1", "blocks.2"));
}

TEST(ModuleTypePolicy, ByNameAcceptsQualifiedUnqualifiedAndHolderNames) {
  Tree tree;
  for (const char* name : {"fsdp::(anonymous namespace)::BlockImpl", "BlockImpl", "Block"}) {
    EXPECT_THAT(Fqns(ModuleTypePolicy::Named({name})->Targets(InputFor(*tree))),
                ElementsAre("blocks.0", "blocks.1", "blocks.2"))
        << name << " vs the module's name() " << tree->blocks[0]->name();
  }
  EXPECT_THAT(Fqns(ModuleTypePolicy::Named({"Linear"})->Targets(InputFor(*tree))),
              ElementsAre("blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.1.attn",
                          "blocks.1.mlp.0", "blocks.1.mlp.1", "blocks.2.attn", "blocks.2.mlp.0",
                          "blocks.2.mlp.1", "head"));
  EXPECT_THAT(Fqns(ModuleTypePolicy::Named({"Lin", "lock"})->Targets(InputFor(*tree))), IsEmpty())
      << "no partial matches";
}

TEST(ModuleTypePolicy, CarriesItsOptionsAndSkipsExcludedSubtrees) {
  Tree tree;
  UnitOptions no_shard;
  no_shard.strategy = ShardingStrategy::kNoShard;
  PolicyInput input = InputFor(*tree);
  const torch::nn::Module* excluded = tree->blocks[1].get();
  input.is_excluded = [excluded](const torch::nn::Module& m) { return &m == excluded; };
  auto targets = ModuleTypePolicy::Named({"Block", "Linear"}, no_shard)->Targets(input);
  EXPECT_THAT(Fqns(targets),
              ElementsAre("blocks.0", "blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.1",
                          "blocks.2", "blocks.2.attn", "blocks.2.mlp.0", "blocks.2.mlp.1",
                          "head"));
  for (const UnitTarget& t : *targets) {
    EXPECT_EQ(t.options.strategy, ShardingStrategy::kNoShard) << t.fqn;
  }
}

TEST(SizeBasedPolicy, WrapsInPostOrderOnceUnwrappedParametersReachTheMinimum) {
  Tree tree;
  SizeBasedOptions options;
  options.min_numel = 2000;
  // Post-order: each block's mlp Sequential (2128) reaches 2000 first; what
  // is left of a block (272) does not; embed (1600) and head (1700) do not;
  // the ModuleList is excluded and the root never a target.
  EXPECT_THAT(Fqns(SizeBasedPolicy(options).Targets(InputFor(*tree))),
              ElementsAre("blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"));
  // Blocks as forced leaves: whole blocks (2400) instead.
  options.force_leaf_names = {"Block"};
  EXPECT_THAT(Fqns(SizeBasedPolicy(options).Targets(InputFor(*tree))),
              ElementsAre("blocks.0", "blocks.1", "blocks.2"));
  // Without excluding the ModuleList, the blocks' leftovers (3 x 272) do
  // not reach 2000 either; with min 1000 and no exclusions, the ModuleList's
  // leftovers still fall short, and embed and head are wrapped.
  options.force_leaf_names.clear();
  options.exclude_names.clear();
  options.min_numel = 1000;
  EXPECT_THAT(Fqns(SizeBasedPolicy(options).Targets(InputFor(*tree))),
              UnorderedElementsAre("embed", "blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.1.mlp.0",
                                   "blocks.1.mlp.1", "blocks.2.mlp.0", "blocks.2.mlp.1", "head"));
}

TEST(SizeBasedPolicy, ConsidersOnlyModulesTheCoreCanHook) {
  Tree tree;
  SizeBasedOptions options;
  options.min_numel = 2000;
  PolicyInput input = InputFor(*tree);
  input.can_be_unit = [](const torch::nn::Module& m) {
    return dynamic_cast<const Hookable*>(&m) != nullptr;
  };
  // The mlp cannot be a unit, so its parameters count towards its block.
  EXPECT_THAT(Fqns(SizeBasedPolicy(options).Targets(input)),
              ElementsAre("blocks.0", "blocks.1", "blocks.2"));
}

// embed (1600) and a head whose weight is embed's (plus 100 of bias).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(at::Tensor tied) {
    weight = register_parameter("weight", tied);
    bias = register_parameter("bias", at::zeros({100}));
  }
  at::Tensor weight, bias;
};
TORCH_MODULE(TiedHead);

struct TiedTreeImpl : torch::nn::Module {
  TiedTreeImpl() {
    embed = register_module("embed", torch::nn::Embedding(100, 16));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block(), Block()));
    head = register_module("head", TiedHead(embed->weight));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(TiedTree);

TEST(SizeBasedPolicy, CountsASharedParameterOnce) {
  TiedTree tree;
  SizeBasedOptions options;
  options.min_numel = 1700;  // head alone would be 1700 if its weight counted again.
  options.force_leaf_names = {"Block"};
  EXPECT_THAT(Fqns(SizeBasedPolicy(options).Targets(InputFor(*tree))),
              ElementsAre("blocks.0", "blocks.1", "blocks.2"));
}

TEST(SizeBasedPolicy, RejectsANonPositiveMinimum) {
  Tree tree;
  SizeBasedOptions options;
  options.min_numel = 0;
  auto targets = SizeBasedPolicy(options).Targets(InputFor(*tree));
  ASSERT_FALSE(targets.ok());
  EXPECT_THAT(targets.status().message(), ::testing::HasSubstr("min_numel must be at least 1"));
}

TEST(LambdaAndCustomPolicies, SeeFqnsAndSetPerUnitOptions) {
  Tree tree;
  LambdaPolicy mlps([](const std::string& fqn, const torch::nn::Module&) {
    return fqn.size() > 4 && fqn.substr(fqn.size() - 4) == ".mlp";
  });
  EXPECT_THAT(Fqns(mlps.Targets(InputFor(*tree))),
              ElementsAre("blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"));

  CustomPolicy custom([](const std::string& fqn,
                         const torch::nn::Module& m) -> std::optional<UnitOptions> {
    if (dynamic_cast<const BlockImpl*>(&m) == nullptr) return std::nullopt;
    UnitOptions options;
    if (fqn == "blocks.0") options.strategy = ShardingStrategy::kNoShard;
    return options;
  });
  auto targets = custom.Targets(InputFor(*tree));
  ASSERT_TRUE(targets.ok());
  ASSERT_EQ(targets->size(), 3u);
  EXPECT_EQ((*targets)[0].options.strategy, ShardingStrategy::kNoShard);
  EXPECT_FALSE((*targets)[1].options.strategy.has_value()) << "unset: the root's value";
}

TEST(SequencePolicy, LaterPoliciesSeeEarlierChoicesAndTheFirstChoiceStands) {
  Tree tree;
  UnitOptions shard_grad_op;
  shard_grad_op.strategy = ShardingStrategy::kShardGradOp;
  UnitOptions no_shard;
  no_shard.strategy = ShardingStrategy::kNoShard;
  std::vector<std::unique_ptr<WrapPolicy>> parts;
  parts.push_back(ModuleTypePolicy::Named({"Block"}, shard_grad_op));
  SizeBasedOptions size;
  size.min_numel = 1000;
  size.options = no_shard;
  parts.push_back(std::make_unique<SizeBasedPolicy>(size));
  SequencePolicy sequence(std::move(parts));
  EXPECT_EQ(sequence.Describe(), "module:Block,strategy=SHARD_GRAD_OP+size:min_numel=1000,"
                                 "exclude=torch::nn::ModuleListImpl|torch::nn::ModuleDictImpl,"
                                 "strategy=NO_SHARD");
  auto targets = sequence.Targets(InputFor(*tree));
  // Blocks first; then the leftovers above 1000: embed and head (the blocks'
  // parameters are held by their units and count for nobody else).
  EXPECT_THAT(Fqns(targets), UnorderedElementsAre("blocks.0", "blocks.1", "blocks.2", "embed",
                                                  "head"));
  for (const UnitTarget& t : *targets) {
    const bool block = t.fqn.rfind("blocks.", 0) == 0;
    EXPECT_EQ(t.options.strategy,
              block ? ShardingStrategy::kShardGradOp : ShardingStrategy::kNoShard)
        << t.fqn;
  }
}

}  // namespace
}  // namespace fsdp
