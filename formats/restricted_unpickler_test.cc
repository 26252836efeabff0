#include "formats/restricted_unpickler.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using namespace std::string_literals;  // "..."s keeps embedded NULs.

absl::StatusOr<PyRef> Read(const std::string& pickle, const UnpicklerHooks& hooks = {}) {
  return Unpickle(pickle.data(), pickle.size(), "test.pkl", hooks);
}

TEST(RestrictedUnpickler, ReadsContainersAndScalars) {
  // {'a': [1, -2, 3.5], 'b': (True, None, 'x')} at protocol 2.
  const std::string pickle =
      "\x80\x02}(X\x01\x00\x00\x00"
      "a]"
      "(K\x01J\xfe\xff\xff\xffG\x40\x0c\x00\x00\x00\x00\x00\x00"
      "eX\x01\x00\x00\x00"
      "b\x88N\x8c\x01x\x87u."s;
  auto value = Read(pickle);
  ASSERT_TRUE(value.ok()) << value.status();
  PyRef a = (*value)->Get("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 3u);
  EXPECT_EQ(a->items[1]->i, -2);
  EXPECT_EQ(a->items[2]->f, 3.5);
  PyRef b = (*value)->Get("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->kind, PyValue::Kind::kTuple);
  EXPECT_EQ(b->items[2]->s, "x");
}

TEST(RestrictedUnpickler, AGlobalOutsideTheAllowListIsRefusedWhereItIsNamed) {
  // os.system('echo pwned') as protocol 0 GLOBAL + REDUCE.
  const std::string pickle =
      "cos\nsystem\n(X\x0a\x00\x00\x00"
      "echo pwnedtR."s;
  UnpicklerHooks hooks;
  bool called = false;
  hooks.allow_global = [](const std::string& global) {
    return global == "torch.Size" ? absl::OkStatus()
                                  : absl::InvalidArgumentError(absl::StrCat(global, " refused"));
  };
  hooks.call = [&called](const std::string&, const std::vector<PyRef>&,
                         bool) -> absl::StatusOr<PyRef> {
    called = true;
    return MakePy(PyValue::Kind::kNone);
  };
  auto value = Read(pickle, hooks);
  ASSERT_FALSE(value.ok());
  EXPECT_THAT(value.status().message(), HasSubstr("test.pkl: os.system refused (at byte 11)"));
  EXPECT_FALSE(called);
  // Without hooks a call is refused too, by name.
  EXPECT_THAT(Read(pickle).status().message(), HasSubstr("the pickle calls os.system"));
}

TEST(RestrictedUnpickler, MalformedPicklesAreErrors) {
  EXPECT_THAT(Read("").status().message(), HasSubstr("ends early"));
  EXPECT_THAT(Read("\x80\x02X\xff\xff\xff\x7f"s).status().message(), HasSubstr("ends early"));
  EXPECT_THAT(Read("a.").status().message(), HasSubstr("stack underflow"));
  EXPECT_THAT(Read("h\x05.").status().message(), HasSubstr("memo 5 was never stored"));
  EXPECT_THAT(Read("K\x01K\x02.").status().message(), HasSubstr("does not end with one value"));
  EXPECT_THAT(Read("i__main__\nX\n.").status().message(), HasSubstr("unsupported pickle opcode"));
}

// l = []; l.append(l) and its indirect forms would never be freed
// (shared ownership): refused, as no file we read holds one.
TEST(RestrictedUnpickler, RecursiveValuesAreRefused) {
  // ] MEMOIZE h0 a: append the list to itself.
  EXPECT_THAT(Read("]\x94h\x00"
                   "a."s)
                  .status()
                  .message(),
              HasSubstr("inside itself"));
  // A = [], B = [A], then B appended to A.
  EXPECT_THAT(Read("]\x94]\x94h\x00"
                   "ah\x00"
                   "h\x01"
                   "a0."s)
                  .status()
                  .message(),
              HasSubstr("already placed inside another value"));
  // A list changed after it went into a tuple.
  EXPECT_THAT(Read("]\x94\x85h\x00"
                   "K\x01"
                   "a0."s)
                  .status()
                  .message(),
              HasSubstr("already placed inside another value"));
}

// A million nested lists: freeing them must not recurse a million deep.
TEST(RestrictedUnpickler, DeepNestingIsFreedWithoutRecursion) {
  constexpr int kDepth = 1000000;
  std::string pickle(kDepth, ']');
  pickle.append(kDepth - 1, 'a');
  pickle += '.';
  auto value = Read(pickle);
  ASSERT_TRUE(value.ok()) << value.status();
  int depth = 1;
  for (const PyValue* v = value->get(); !v->items.empty(); v = v->items[0].get()) ++depth;
  EXPECT_EQ(depth, kDepth);
}

}  // namespace
}  // namespace fsdp
