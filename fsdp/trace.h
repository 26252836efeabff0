// Per-rank observability of the FSDP runtime: a trace of what each unit did
// and when, in Chrome's trace-event JSON (open it in Perfetto or
// chrome://tracing), and a debug log of training-state transitions.
//
//   fsdp::TraceRecorder trace(/*rank=*/comm.rank());
//   options.trace = &trace;                        // before Wrap
//   ... train ...
//   FSDP_RETURN_IF_ERROR(trace.WriteChromeTrace("trace_rank0.json"));
//
// Events are complete spans ("ph": "X") named by what happened, with the
// unit's FQN in args.unit ("<root>" for the root): forward and backward of each
// unit, unshard (issue and wait of its all-gather together) and reshard,
// all-gather issue and all-gather wait separately, and reduce-scatter (the
// gradient reduction, all-reduce for NO_SHARD). pid is the rank, tid a small
// number per host thread (autograd may run hooks on its own threads).
// Recording costs two clock reads and one locked append per span; without a
// recorder the runtime pays one pointer test.
#ifndef FSDP_FSDP_TRACE_H_
#define FSDP_FSDP_TRACE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ATen/record_function.h"
#include "absl/status/status.h"

namespace fsdp {

struct TraceEvent {
  std::string name;      // "forward", "all-gather wait", ...
  std::string unit;      // The unit's FQN; "<root>" for the root.
  // On the host's monotonic clock, shared by all processes of the host: the
  // traces of local ranks line up when opened together.
  int64_t begin_us = 0;
  int64_t duration_us = 0;
  int tid = 0;
};

class TraceRecorder {
 public:
  explicit TraceRecorder(int rank);
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  int64_t NowUs() const;
  void AddSpan(std::string name, std::string unit, int64_t begin_us, int64_t end_us);

  std::vector<TraceEvent> Events() const;  // In the order spans ended.
  // Writes {"traceEvents": [...]} atomically (a temporary file renamed into
  // place); fails naming the path.
  absl::Status WriteChromeTrace(const std::string& path) const;

 private:
  const int rank_;
  mutable std::mutex mutex_;
  std::vector<TraceEvent> events_;
  std::vector<std::thread::id> threads_;  // tid = index + 1.
};

// One phase of one unit, from construction to End() (or destruction): a
// span in `recorder` (when not null), and a range "fsdp::<name> <unit>" in
// torch.profiler's trace (Kineto; Nsight through NVTX mode) while a
// profiler is recording. Without either it costs a pointer test and a
// check for profiler callbacks. Default-constructed: nothing happened.
// Movable, so that a phase that begins in one hook and ends in another
// (a unit's forward, its backward) is held by the unit.
class TraceSpan {
 public:
  TraceSpan() = default;
  TraceSpan(TraceRecorder* recorder, const char* name, const std::string& unit);
  TraceSpan(TraceSpan&& other) noexcept;
  TraceSpan& operator=(TraceSpan&& other) noexcept;
  ~TraceSpan();

  void End();

 private:
  TraceRecorder* recorder_ = nullptr;
  const char* name_ = nullptr;
  std::string unit_;
  int64_t begin_us_ = 0;
  std::unique_ptr<at::RecordFunction> profiler_range_;
};

// Receives one line per training-state transition of the model or a unit,
// e.g. "unit 'transformer.h.0': IDLE -> FORWARD".
using DebugLog = std::function<void(const std::string& line)>;

}  // namespace fsdp

#endif  // FSDP_FSDP_TRACE_H_
