// The runtime's observability: the state-transition log of one iteration and
// the per-rank Chrome trace (fsdp/trace.h).
#include "fsdp/flat_param_handle.h"
#include "fsdp/trace.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ATen/ATen.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_models.h"
#include "fsdp/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/multi_rank.h"
#include "testing/torch_python.h"
#include "torch/csrc/autograd/profiler_legacy.h"

namespace fsdp {
namespace {

using ::fsdp::testing::BlockImpl;
using ::fsdp::testing::Inputs;
using ::fsdp::testing::Net;
using ::fsdp::testing::RunOnThreadRanks;
using ::testing::ElementsAre;

// One forward and backward of the three-block net at W = 2 with `options`.
void OneIteration(Collectives& comm, const FsdpOptions& options) {
  Net model;
  auto wrapped =
      FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  model->forward(Inputs(/*step=*/0, /*micro=*/0)).sum().backward();
}

TEST(DebugLog, ShowsEveryStateTransitionOfAnIteration) {
  std::vector<std::string> lines;
  ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                FsdpOptions options;
                if (comm.rank() == 0) {
                  options.debug_log = [&](const std::string& line) { lines.push_back(line); };
                }
                OneIteration(comm, options);
              }).ok());
  // Forward in pre-order; backward in reverse, each unit reducing as soon as
  // its gradients are in (the root's head first, since its gradient comes
  // first) and, by default (BACKWARD_PRE), prefetching the next unit's
  // parameters from its pre hook; the end-of-backward callback returns
  // every unit to IDLE.
  EXPECT_THAT(lines, ElementsAre("unit '<root>': IDLE -> FORWARD",
                                 "model: IDLE -> FORWARD_BACKWARD",
                                 "unit 'blocks.0': IDLE -> FORWARD",
                                 "unit 'blocks.0': FORWARD -> IDLE",
                                 "unit 'blocks.1': IDLE -> FORWARD",
                                 "unit 'blocks.1': FORWARD -> IDLE",
                                 "unit 'blocks.2': IDLE -> FORWARD",
                                 "unit 'blocks.2': FORWARD -> IDLE",
                                 "unit '<root>': FORWARD -> IDLE",
                                 "unit '<root>': IDLE -> BACKWARD_PRE",
                                 "unit 'blocks.2': all-gather prefetched (backward)",
                                 "unit '<root>': BACKWARD_PRE -> BACKWARD_POST",
                                 "unit 'blocks.2': IDLE -> BACKWARD_PRE",
                                 "unit 'blocks.1': all-gather prefetched (backward)",
                                 "unit 'blocks.2': BACKWARD_PRE -> BACKWARD_POST",
                                 "unit 'blocks.1': IDLE -> BACKWARD_PRE",
                                 "unit 'blocks.0': all-gather prefetched (backward)",
                                 "unit 'blocks.1': BACKWARD_PRE -> BACKWARD_POST",
                                 "unit 'blocks.0': IDLE -> BACKWARD_PRE",
                                 "unit 'blocks.0': BACKWARD_PRE -> BACKWARD_POST",
                                 "unit '<root>': BACKWARD_POST -> IDLE",
                                 "unit 'blocks.0': BACKWARD_POST -> IDLE",
                                 "unit 'blocks.1': BACKWARD_POST -> IDLE",
                                 "unit 'blocks.2': BACKWARD_POST -> IDLE",
                                 "model: FORWARD_BACKWARD -> IDLE"));
}

// Backward prefetch happens, where asked: the next unit's all-gather is
// issued inside the current unit's backward (BACKWARD_PRE: between its
// pre hook and its post hook), right after it (BACKWARD_POST: after its
// post hook, before the next unit's pre hook), or not at all (NONE: the
// next unit gathers in its own pre hook). Forward prefetch likewise, one
// unit ahead in forward, from the second iteration on (the first records
// the order). The debug log orders them on one thread.
TEST(DebugLog, PrefetchIssuesTheNextUnitsAllGatherWhereAsked) {
  // The lines of the last of `iterations`.
  auto lines_of = [](BackwardPrefetch backward, bool forward, int iterations = 1) {
    std::vector<std::string> lines;
    EXPECT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                  FsdpOptions options;
                  options.backward_prefetch = backward;
                  options.forward_prefetch = forward;
                  if (comm.rank() == 0) {
                    options.debug_log = [&](const std::string& line) { lines.push_back(line); };
                  }
                  Net model;
                  auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                         *ModuleTypePolicy::Of<BlockImpl>());
                  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
                  for (int i = 0; i < iterations; ++i) {
                    if (comm.rank() == 0) lines.clear();  // Only rank 0's are kept.
                    model->forward(Inputs(/*step=*/i, /*micro=*/0)).sum().backward();
                  }
                }).ok());
    return lines;
  };
  auto position = [](const std::vector<std::string>& lines, const std::string& line) {
    auto it = std::find(lines.begin(), lines.end(), line);
    EXPECT_NE(it, lines.end()) << line;
    return it - lines.begin();
  };
  const std::string prefetched = "unit 'blocks.1': all-gather prefetched (backward)";
  const std::string pre2 = "unit 'blocks.2': IDLE -> BACKWARD_PRE";
  const std::string post2 = "unit 'blocks.2': BACKWARD_PRE -> BACKWARD_POST";
  const std::string pre1 = "unit 'blocks.1': IDLE -> BACKWARD_PRE";

  const std::vector<std::string> pre = lines_of(BackwardPrefetch::kBackwardPre, false);
  EXPECT_LT(position(pre, pre2), position(pre, prefetched));
  EXPECT_LT(position(pre, prefetched), position(pre, post2));

  const std::vector<std::string> post = lines_of(BackwardPrefetch::kBackwardPost, false);
  EXPECT_LT(position(post, post2), position(post, prefetched));
  EXPECT_LT(position(post, prefetched), position(post, pre1));

  const std::vector<std::string> none = lines_of(BackwardPrefetch::kNone, false);
  EXPECT_EQ(std::count_if(none.begin(), none.end(),
                          [](const std::string& line) {
                            return line.find("prefetched") != std::string::npos;
                          }),
            0);

  // Forward: blocks.1's all-gather is issued while blocks.0 runs forward.
  const std::vector<std::string> forward = lines_of(BackwardPrefetch::kNone, true, 2);
  const auto ahead = position(forward, "unit 'blocks.1': all-gather prefetched (forward)");
  EXPECT_LT(position(forward, "unit 'blocks.0': IDLE -> FORWARD"), ahead);
  EXPECT_LT(ahead, position(forward, "unit 'blocks.0': FORWARD -> IDLE"));
}

// Explicit prefetch lists (FSDP2's set_modules_to_forward_prefetch and
// set_modules_to_backward_prefetch): the named units' all-gathers are issued
// in the given order right after the unit's own, from the first iteration
// on and without forward_prefetch; an empty list turns a unit's backward
// prefetch off. The gradients are those of a run without lists.
TEST(DebugLog, ExplicitPrefetchListsIssueTheNamedAllGathers) {
  auto run = [](bool lists, std::vector<std::string>* lines, std::vector<at::Tensor>* grads) {
    EXPECT_TRUE(
        RunOnThreadRanks(2, [&](Collectives& comm) {
          FsdpOptions options;
          if (comm.rank() == 0) {
            options.debug_log = [&](const std::string& line) { lines->push_back(line); };
          }
          Net model;
          auto wrapped = FullyShardedModel::Wrap(model.ptr(), comm, options,
                                                 *ModuleTypePolicy::Of<BlockImpl>());
          ASSERT_TRUE(wrapped.ok()) << wrapped.status();
          const torch::nn::Module* block[3];
          for (int i = 0; i < 3; ++i) block[i] = model->blocks[i].get();
          if (lists) {
            FullyShardedModel& m = **wrapped;
            ASSERT_TRUE(m.SetModulesToForwardPrefetch(*block[0], {block[1], block[2]}).ok());
            ASSERT_TRUE(m.SetModulesToBackwardPrefetch(*model, {block[0]}).ok());
            ASSERT_TRUE(m.SetModulesToBackwardPrefetch(*block[2], {}).ok());
            ASSERT_TRUE(m.SetModulesToBackwardPrefetch(*block[1], {}).ok());
            // Refused by name: a module inside a unit, and in the list.
            const absl::Status inner = m.SetModulesToForwardPrefetch(*model->head, {block[1]});
            EXPECT_EQ(inner.code(), absl::StatusCode::kNotFound);
            EXPECT_THAT(std::string(inner.message()),
                        ::testing::HasSubstr("is not a unit of this model"));
            const absl::Status listed =
                m.SetModulesToBackwardPrefetch(*block[1], {block[0], model->head.get()});
            EXPECT_EQ(listed.code(), absl::StatusCode::kNotFound);
            EXPECT_THAT(std::string(listed.message()), ::testing::HasSubstr("modules[1]"));
          }
          if (comm.rank() == 0) lines->clear();
          model->forward(Inputs(/*step=*/0, /*micro=*/0)).sum().backward();
          if (comm.rank() == 0) {
            for (const at::Tensor& p : model->parameters()) grads->push_back(p.grad().clone());
          }
        }).ok());
  };
  std::vector<std::string> lines, default_lines;
  std::vector<at::Tensor> grads, default_grads;
  run(true, &lines, &grads);
  run(false, &default_lines, &default_grads);
  auto position = [&](const std::string& line) {
    auto it = std::find(lines.begin(), lines.end(), line);
    EXPECT_NE(it, lines.end()) << line;
    return it - lines.begin();
  };
  const auto gather1 = position("unit 'blocks.1': all-gather prefetched (forward)");
  const auto gather2 = position("unit 'blocks.2': all-gather prefetched (forward)");
  EXPECT_LT(position("unit 'blocks.0': IDLE -> FORWARD"), gather1);
  EXPECT_LT(gather1, gather2);
  EXPECT_LT(gather2, position("unit 'blocks.0': FORWARD -> IDLE"));
  const auto gather0 = position("unit 'blocks.0': all-gather prefetched (backward)");
  EXPECT_LT(position("unit '<root>': IDLE -> BACKWARD_PRE"), gather0);
  EXPECT_LT(gather0, position("unit 'blocks.2': IDLE -> BACKWARD_PRE"));
  for (const std::string unit : {"blocks.1", "blocks.2"}) {
    EXPECT_EQ(std::count(lines.begin(), lines.end(),
                         "unit '" + unit + "': all-gather prefetched (backward)"),
              0)
        << unit;
  }
  ASSERT_EQ(grads.size(), default_grads.size());
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(at::equal(grads[i], default_grads[i])) << i;
}

// Three blocks under a root that holds no parameters of its own: the root's
// unit has no handle.
struct StackImpl : torch::nn::Module, ShardableModule {
  StackImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(::fsdp::testing::Block(7, 13, 0));
    blocks->push_back(::fsdp::testing::Block(13, 11, 1));
    blocks->push_back(::fsdp::testing::Block(11, 9, 2));
    ::fsdp::testing::FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
    // Math of its own after the blocks: on blocks.2's output tensor itself,
    // blocks.2's pre-backward hook would run first (registration order).
    return unit.Return(0.5 * x);
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Stack);

// Rank 0's debug log and gradients of one iteration at W = 2.
struct LoggedIteration {
  std::vector<std::string> lines;
  std::vector<at::Tensor> grads;
};

// One iteration of a freshly wrapped `Model` (Net or Stack, blocks wrapped)
// with `backward` prefetch, after `configure` (every rank) sets its lists;
// `after_forward` runs on every rank between forward and backward.
template <typename Model>
LoggedIteration RunLogged(
    BackwardPrefetch backward,
    const std::function<void(FullyShardedModel&, Model&)>& configure = nullptr,
    const std::function<void(FullyShardedModel&)>& after_forward = nullptr) {
  LoggedIteration result;
  EXPECT_TRUE(
      RunOnThreadRanks(2, [&](Collectives& comm) {
        FsdpOptions options;
        options.backward_prefetch = backward;
        if (comm.rank() == 0) {
          options.debug_log = [&](const std::string& line) { result.lines.push_back(line); };
        }
        Model model;
        auto wrapped =
            FullyShardedModel::Wrap(model.ptr(), comm, options, *ModuleTypePolicy::Of<BlockImpl>());
        ASSERT_TRUE(wrapped.ok()) << wrapped.status();
        if (configure) configure(**wrapped, model);
        at::Tensor out = model->forward(Inputs(/*step=*/0, /*micro=*/0));
        if (after_forward) after_forward(**wrapped);
        out.sum().backward();
        if (comm.rank() == 0) {
          for (const at::Tensor& p : model->parameters()) {
            result.grads.push_back(p.grad().clone());
          }
        }
      }).ok());
  return result;
}

int64_t Position(const std::vector<std::string>& lines, const std::string& line) {
  auto it = std::find(lines.begin(), lines.end(), line);
  EXPECT_NE(it, lines.end()) << line;
  return it - lines.begin();
}

int64_t Count(const std::vector<std::string>& lines, const std::string& line) {
  return std::count(lines.begin(), lines.end(), line);
}

void ExpectEqualGradients(const LoggedIteration& got, const LoggedIteration& want) {
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(got.grads[i], want.grads[i])) << i;
  }
}

// Guards: a unit without a handle issues its lists too (its own pre hooks
// return early, before any prefetch of the default order).
TEST(DebugLog, UnitWithoutParametersIssuesItsPrefetchLists) {
  auto configure = [](FullyShardedModel& m, Stack& model) {
    const torch::nn::Module* block[3];
    for (int i = 0; i < 3; ++i) block[i] = model->blocks[i].get();
    ASSERT_EQ(m.units()[0]->handle(), nullptr) << "the root holds no parameters";
    ASSERT_TRUE(m.SetModulesToForwardPrefetch(*model, {block[0], block[1]}).ok());
    ASSERT_TRUE(m.SetModulesToBackwardPrefetch(*model, {block[2], block[1]}).ok());
  };
  const LoggedIteration listed = RunLogged<Stack>(BackwardPrefetch::kBackwardPre, configure);
  const LoggedIteration plain = RunLogged<Stack>(BackwardPrefetch::kBackwardPre);
  const std::vector<std::string>& lines = listed.lines;
  // Forward: both issued by the root's pre-forward, before blocks.0 runs.
  const auto gather0 = Position(lines, "unit 'blocks.0': all-gather prefetched (forward)");
  const auto gather1 = Position(lines, "unit 'blocks.1': all-gather prefetched (forward)");
  EXPECT_LT(Position(lines, "model: IDLE -> FORWARD_BACKWARD"), gather0);
  EXPECT_LT(gather0, gather1);
  EXPECT_LT(gather1, Position(lines, "unit 'blocks.0': IDLE -> FORWARD"));
  // Backward: both issued by the root's pre-backward, before blocks.2's;
  // blocks.2's own prefetch of blocks.1 then finds it pending.
  const std::string back2 = "unit 'blocks.2': all-gather prefetched (backward)";
  const std::string back1 = "unit 'blocks.1': all-gather prefetched (backward)";
  EXPECT_LT(Position(lines, back2), Position(lines, back1));
  EXPECT_LT(Position(lines, back1), Position(lines, "unit 'blocks.2': IDLE -> BACKWARD_PRE"));
  EXPECT_EQ(Count(lines, back1), 1);
  // Without lists the handle-less root prefetches nothing.
  for (const std::string& line :
       {back2, std::string("unit 'blocks.0': all-gather prefetched (forward)")}) {
    EXPECT_EQ(Count(plain.lines, line), 0) << line;
  }
  ExpectEqualGradients(listed, plain);
}

// Guards: in forward, a listed unit that already ran is gathered again and
// that gather serves its backward (no second gather there).
TEST(DebugLog, ForwardListRegathersAUnitThatAlreadyRanAndKeepsItForBackward) {
  const std::string forward0 = "unit 'blocks.0': all-gather prefetched (forward)";
  const std::string backward0 = "unit 'blocks.0': all-gather prefetched (backward)";
  const LoggedIteration listed = RunLogged<Net>(
      BackwardPrefetch::kBackwardPre,
      [](FullyShardedModel& m, Net& model) {
        ASSERT_TRUE(
            m.SetModulesToForwardPrefetch(*model->blocks[2], {model->blocks[0].get()}).ok());
      },
      [](FullyShardedModel& m) {
        // Between forward and backward: blocks.0's gather is still held.
        ASSERT_EQ(m.units()[1]->fqn(), "blocks.0");
        EXPECT_TRUE(m.units()[1]->handle()->has_pending_unshard());
      });
  const LoggedIteration plain = RunLogged<Net>(BackwardPrefetch::kBackwardPre);
  const std::vector<std::string>& lines = listed.lines;
  const auto gather = Position(lines, forward0);
  EXPECT_LT(Position(lines, "unit 'blocks.0': FORWARD -> IDLE"), gather);
  EXPECT_LT(Position(lines, "unit 'blocks.2': IDLE -> FORWARD"), gather);
  EXPECT_LT(gather, Position(lines, "unit 'blocks.2': FORWARD -> IDLE"));
  // blocks.1's backward prefetch of blocks.0 finds it pending; without the
  // list it issues one.
  EXPECT_EQ(Count(lines, backward0), 0);
  EXPECT_EQ(Count(plain.lines, backward0), 1);
  EXPECT_EQ(Count(plain.lines, forward0), 0);
  ExpectEqualGradients(listed, plain);
}

// Guards: under BACKWARD_POST an explicit backward list is issued from the
// pre-backward hook, not after the unit's reduction.
TEST(DebugLog, ExplicitBackwardListUnderBackwardPostIsIssuedFromThePreHook) {
  const LoggedIteration listed = RunLogged<Net>(
      BackwardPrefetch::kBackwardPost, [](FullyShardedModel& m, Net& model) {
        ASSERT_TRUE(m.SetModulesToBackwardPrefetch(
                         *model->blocks[2], {model->blocks[1].get(), model->blocks[0].get()})
                        .ok());
      });
  const LoggedIteration plain = RunLogged<Net>(BackwardPrefetch::kBackwardPost);
  const std::vector<std::string>& lines = listed.lines;
  const std::string back1 = "unit 'blocks.1': all-gather prefetched (backward)";
  const std::string back0 = "unit 'blocks.0': all-gather prefetched (backward)";
  EXPECT_LT(Position(lines, "unit 'blocks.2': IDLE -> BACKWARD_PRE"), Position(lines, back1));
  EXPECT_LT(Position(lines, back1), Position(lines, back0));
  const std::string post2 = "unit 'blocks.2': BACKWARD_PRE -> BACKWARD_POST";
  EXPECT_LT(Position(lines, back0), Position(lines, post2));
  // Issued once each: blocks.1's post-hook prefetch of blocks.0 finds it
  // pending. Without the list, blocks.1 is prefetched after blocks.2's post.
  EXPECT_EQ(Count(lines, back1), 1);
  EXPECT_EQ(Count(lines, back0), 1);
  EXPECT_LT(Position(plain.lines, post2), Position(plain.lines, back1));
  ExpectEqualGradients(listed, plain);
}

TEST(Trace, RecordsEachUnitsWorkAndWritesChromeTraceJson) {
  std::vector<TraceEvent> events;
  std::string path = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                                             : "/tmp") +
                     "/trace_rank0.json";
  ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                TraceRecorder trace(comm.rank());
                FsdpOptions options;
                options.trace = &trace;
                OneIteration(comm, options);
                if (comm.rank() == 0) {
                  events = trace.Events();
                  ASSERT_TRUE(trace.WriteChromeTrace(path).ok());
                }
              }).ok());
  std::map<std::string, std::map<std::string, int>> count;  // unit -> name -> spans
  std::map<std::string, TraceEvent> forward, backward;
  for (const TraceEvent& e : events) {
    EXPECT_GE(e.duration_us, 0);
    ++count[e.unit][e.name];
    if (e.name == "forward") forward[e.unit] = e;
    if (e.name == "backward") backward[e.unit] = e;
  }
  for (const std::string unit : {"blocks.0", "blocks.1", "blocks.2"}) {
    SCOPED_TRACE(unit);
    // FULL_SHARD: gathered for forward and again for backward, freed after
    // each, gradients reduce-scattered once.
    EXPECT_EQ(count[unit]["forward"], 1);
    EXPECT_EQ(count[unit]["backward"], 1);
    EXPECT_EQ(count[unit]["unshard"], 2);
    EXPECT_EQ(count[unit]["all-gather issue"], 2);
    EXPECT_EQ(count[unit]["all-gather wait"], 2);
    EXPECT_EQ(count[unit]["reshard"], 2);
    EXPECT_EQ(count[unit]["reduce-scatter"], 1);
    // Within the root's forward and backward.
    EXPECT_GE(forward[unit].begin_us, forward["<root>"].begin_us);
    EXPECT_LE(forward[unit].begin_us + forward[unit].duration_us,
              forward["<root>"].begin_us + forward["<root>"].duration_us);
    EXPECT_GE(backward[unit].begin_us, forward["<root>"].begin_us + forward["<root>"].duration_us);
  }
  // The root keeps its parameters from forward into backward.
  EXPECT_EQ(count["<root>"]["unshard"], 1);
  EXPECT_EQ(count["<root>"]["reduce-scatter"], 1);
  // Backward runs the blocks in reverse.
  EXPECT_LT(backward["blocks.2"].begin_us, backward["blocks.1"].begin_us);
  EXPECT_LT(backward["blocks.1"].begin_us, backward["blocks.0"].begin_us);
  // The file is JSON with every span and the process named by the rank.
  const std::string check =
      ::fsdp::testing::TorchPython() + " -c \"import json,sys; d=json.load(open('" + path +
      "')); e=d['traceEvents']; sys.exit(0 if len(e)==" + std::to_string(events.size() + 1) +
      " and e[0]['args']['name']=='rank 0' and "
      "all(x['ph']=='X' and x['pid']==0 for x in e[1:]) else 1)\"";
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
}

// The same phases are ranges in libtorch's profiler (torch.profiler in a
// Python host process, Kineto, Nsight in NVTX mode) whenever one records,
// with or without a TraceRecorder: here the legacy profiler's Chrome trace.
TEST(Trace, PhasesAreProfilerRanges) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR")
                                                                   : "/tmp") +
                           "/profile_rank0.json";
  ASSERT_TRUE(RunOnThreadRanks(2, [&](Collectives& comm) {
                std::optional<torch::autograd::profiler::RecordProfile> profile;
                if (comm.rank() == 0) profile.emplace(path);
                OneIteration(comm, FsdpOptions());
              }).ok());
  std::ifstream file(path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  auto count = [&](const std::string& name) {
    int n = 0;
    for (size_t at = text.find("\"" + name + "\""); at != std::string::npos;
         at = text.find("\"" + name + "\"", at + 1)) {
      ++n;
    }
    return n;
  };
  for (const std::string unit : {"blocks.0", "blocks.1", "blocks.2"}) {
    SCOPED_TRACE(unit);
    EXPECT_EQ(count("fsdp::forward " + unit), 1);
    EXPECT_EQ(count("fsdp::backward " + unit), 1);
    EXPECT_EQ(count("fsdp::unshard " + unit), 2);
    EXPECT_EQ(count("fsdp::reshard " + unit), 2);
    EXPECT_EQ(count("fsdp::reduce-scatter " + unit), 1);
  }
  EXPECT_EQ(count("fsdp::forward <root>"), 1);
}

}  // namespace
}  // namespace fsdp
