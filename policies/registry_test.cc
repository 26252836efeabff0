#include "policies/registry.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "policies/wrap_policy.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kExamplePlugin[] = "policies/examples/libfqn_glob_policy.so";

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    h = register_module("h", torch::nn::ModuleList(Block(), Block()));
    head = register_module("head", torch::nn::Linear(8, 300));
  }
  torch::nn::ModuleList h{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Model);

std::vector<std::string> TargetsOf(const WrapPolicy& policy, const torch::nn::Module& root) {
  PolicyInput input;
  input.root = &root;
  auto targets = policy.Targets(input);
  EXPECT_TRUE(targets.ok()) << targets.status();
  std::vector<std::string> fqns;
  if (targets.ok()) {
    for (const UnitTarget& t : *targets) fqns.push_back(t.fqn + (t.options.empty() ? "" : " " + t.options.ToString()));
  }
  return fqns;
}

TEST(PolicyRegistry, BuiltInsAreRegisteredAndBuildFromSpecs) {
  std::vector<std::string> names;
  for (const auto& entry : PolicyRegistry::Global().List()) names.push_back(entry.name);
  EXPECT_THAT(names, ::testing::IsSupersetOf({"module", "none", "size"}));
  Model model;
  auto blocks = PolicyRegistry::Global().Build("module:Block");
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  EXPECT_THAT(TargetsOf(**blocks, *model), ElementsAre("h.0", "h.1"));
  auto overridden = PolicyRegistry::Global().Build(" module : Block , strategy=shard_grad_op ");
  ASSERT_TRUE(overridden.ok()) << overridden.status();
  EXPECT_THAT(TargetsOf(**overridden, *model),
              ElementsAre("h.0 strategy=SHARD_GRAD_OP", "h.1 strategy=SHARD_GRAD_OP"));
  auto mixed = PolicyRegistry::Global().Build(
      "module:Block,param_dtype=bf16,reduce_dtype=float32,output_dtype=fp32,"
      "cast_forward_inputs=true");
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  const std::string mp =
      "param_dtype=bfloat16,reduce_dtype=float32,output_dtype=float32,cast_forward_inputs=true";
  EXPECT_THAT(TargetsOf(**mixed, *model), ElementsAre("h.0 " + mp, "h.1 " + mp));
  // Blocks, then what is left above 2000 elements (the head's 2700).
  auto sequence = PolicyRegistry::Global().Build("module:Block+size:min_numel=2000");
  ASSERT_TRUE(sequence.ok()) << sequence.status();
  EXPECT_THAT(TargetsOf(**sequence, *model), ElementsAre("h.0", "h.1", "head"));
  auto none = PolicyRegistry::Global().Build("none");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(TargetsOf(**none, *model).empty());
}

TEST(PolicyRegistry, BadSpecsAreErrorsNamingTheProblem) {
  struct Bad {
    const char* spec;
    const char* message;
  };
  for (const Bad& bad : std::vector<Bad>{
           {"", "empty spec"},
           {"module:Block++size", "empty policy between '+'"},
           {"mod ule:Block", "bad policy name 'mod ule'"},
           {"module:Block,,Linear", "empty argument"},
           {"module:Block,strategy=", "no value in 'strategy='"},
           {"module", "'module' needs at least one module type name"},
           {"module:Block,strategy=HALF_SHARD", "unknown sharding strategy 'HALF_SHARD'"},
           {"size:min_numel=lots", "'min_numel' must be an integer, got 'lots'"},
           {"size:min_numel=0", "min_numel must be at least 1"},
           {"size:min_numel=5,min_numel=6", "'min_numel' given twice"},
           {"size:bogus=1",
            "policy 'size' has no argument 'bogus' (it takes: strategy, "
            "param_dtype, reduce_dtype, buffer_dtype, output_dtype, "
            "keep_low_precision_grads, cast_forward_inputs, all_gather_quantization, "
            "reduce_quantization, "
            "min_numel, exclude, force_leaf)"},
           {"module:Block,all_gather_quantization=int4",
            "unknown quantization 'int4'; valid: none, bf16, int8"},
           {"module:Block,param_dtype=fp8", "param_dtype: unknown dtype 'fp8'"},
           // Other scalar types are not mixed-precision dtypes.
           {"module:Block,reduce_dtype=int8", "reduce_dtype: unknown dtype 'int8'"},
           {"module:Block,buffer_dtype=float64", "buffer_dtype: unknown dtype 'float64'"},
           {"module:Block,cast_forward_inputs=yes",
            "'cast_forward_inputs' must be true or false, got 'yes'"},
           {"size:1000", "takes only key=value arguments, got '1000'"},
           {"none:x", "'none' takes no arguments"},
           {"nosuch:x", "no policy named 'nosuch' (registered: "},
       }) {
    auto policy = PolicyRegistry::Global().Build(bad.spec);
    ASSERT_FALSE(policy.ok()) << bad.spec;
    EXPECT_THAT(policy.status().message(), HasSubstr(bad.message)) << bad.spec;
  }
}

TEST(PolicyRegistry, DuplicateAndInvalidNamesAreRefused) {
  PolicyRegistry registry;
  auto factory = [](const PolicySpec&) -> absl::StatusOr<std::unique_ptr<WrapPolicy>> {
    return std::unique_ptr<WrapPolicy>(new NoUnitsPolicy());
  };
  ASSERT_TRUE(registry.Register("mine", "help", factory).ok());
  absl::Status again = registry.Register("mine", "help", factory);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.message(), HasSubstr("'mine' from linked in is already registered"));
  EXPECT_EQ(registry.Register("no spaces", "help", factory).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Register("empty", "help", nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // A duplicate static registration cannot fail at startup; every Build
  // reports it instead of silently keeping one of the two.
  registry.RecordStartupError("wrap policy 'x' from linked in is already registered");
  auto built = registry.Build("mine");
  ASSERT_FALSE(built.ok());
  EXPECT_THAT(built.status().message(), HasSubstr("registry is inconsistent: wrap policy 'x'"));
}

TEST(PolicyPlugins, ExamplePluginLoadsRegistersAndBuilds) {
  PolicyRegistry registry;
  absl::Status loaded = LoadPolicyPlugin(kExamplePlugin, registry);
  ASSERT_TRUE(loaded.ok()) << loaded;
  ASSERT_EQ(registry.List().size(), 1u);
  EXPECT_EQ(registry.List()[0].name, "fqn_glob");
  EXPECT_THAT(registry.List()[0].origin, HasSubstr("libfqn_glob_policy.so"));
  Model model;
  auto policy = registry.Build("fqn_glob:h.*,strategy=NO_SHARD");
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_THAT(TargetsOf(**policy, *model),
              ElementsAre("h.0 strategy=NO_SHARD", "h.1 strategy=NO_SHARD"));
  auto deep = registry.Build("fqn_glob:**.fc,head");
  ASSERT_TRUE(deep.ok()) << deep.status();
  EXPECT_THAT(TargetsOf(**deep, *model), ElementsAre("h.0.fc", "h.1.fc", "head"));
  auto no_pattern = registry.Build("fqn_glob");
  ASSERT_FALSE(no_pattern.ok());
  EXPECT_THAT(no_pattern.status().message(), HasSubstr("fqn_glob needs a pattern"));
  // Loading it again would register the name twice.
  absl::Status twice = LoadPolicyPlugin(kExamplePlugin, registry);
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(twice.message(), HasSubstr("'fqn_glob' from plugin "));
}

TEST(PolicyPlugins, LoaderErrorsNameTheCause) {
  PolicyRegistry registry;
  absl::Status missing = LoadPolicyPlugin("policies/examples/no_such_plugin.so", registry);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(),
              HasSubstr("cannot load wrap policy plugin 'policies/examples/no_such_plugin.so'"));

  absl::Status not_plugin =
      LoadPolicyPlugin("policies/testdata/libnot_a_policy_plugin.so", registry);
  EXPECT_EQ(not_plugin.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(not_plugin.message(),
              HasSubstr("is not a wrap policy plugin: it has no entry point "
                        "'fsdp_policy_plugin_info'"));

  absl::Status wrong_abi = LoadPolicyPlugin("policies/testdata/libwrong_abi_policy.so", registry);
  EXPECT_EQ(wrong_abi.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong_abi.message(),
              HasSubstr("was built for plugin ABI version 999, but this program expects "
                        "version 1"));
  EXPECT_TRUE(registry.List().empty());
}

TEST(PolicyPlugins, ADuplicateNameRegistersNothingOfThePlugin) {
  absl::Status status =
      LoadPolicyPlugin("policies/testdata/libduplicate_name_policy.so", PolicyRegistry::Global());
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(status.message(), HasSubstr("wrap policy 'module' from plugin "));
  EXPECT_THAT(status.message(), HasSubstr("already registered (from linked in)"));
  for (const auto& entry : PolicyRegistry::Global().List()) {
    EXPECT_NE(entry.name, "fresh_policy") << "all-or-nothing";
  }
  EXPECT_TRUE(PolicyRegistry::Global().Build("module:Block").ok()) << "built-ins unaffected";
}

}  // namespace
}  // namespace fsdp
