#include "fsdp/unit_registry.h"

#include "gtest/gtest.h"
#include "torch/nn/module.h"

namespace fsdp {
namespace {

// The registry only stores unit pointers; these are never dereferenced.
FsdpUnit* FakeUnit(int k) { return reinterpret_cast<FsdpUnit*>(0x1000 * k); }

TEST(UnitRegistry, RegistersAllOrNothingAndRemovesOnlyItsOwnEntries) {
  torch::nn::Module a, b, c;
  ASSERT_EQ(RegisterUnits({{&a, FakeUnit(1)}}), std::nullopt);
  EXPECT_EQ(GetModuleUnit(&a), FakeUnit(1));

  // A second model claiming b and a: refused at a (index 1), b untouched.
  EXPECT_EQ(RegisterUnits({{&b, FakeUnit(2)}, {&a, FakeUnit(3)}}), std::optional<size_t>(1));
  EXPECT_EQ(GetModuleUnit(&b), nullptr);
  EXPECT_EQ(GetModuleUnit(&a), FakeUnit(1));

  // That model's destruction must not remove the first model's entry.
  UnregisterUnits({{&b, FakeUnit(2)}, {&a, FakeUnit(3)}});
  EXPECT_EQ(GetModuleUnit(&a), FakeUnit(1));

  ASSERT_EQ(RegisterUnits({{&b, FakeUnit(2)}, {&c, FakeUnit(2)}}), std::nullopt);
  UnregisterUnits({{&a, FakeUnit(1)}, {&b, FakeUnit(2)}, {&c, FakeUnit(2)}});
  EXPECT_EQ(GetModuleUnit(&a), nullptr);
  EXPECT_EQ(GetModuleUnit(&b), nullptr);
  EXPECT_EQ(GetModuleUnit(&c), nullptr);
}

}  // namespace
}  // namespace fsdp
