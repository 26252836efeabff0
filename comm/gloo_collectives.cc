#include "comm/gloo_collectives.h"

#include <signal.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "c10/util/Exception.h"
#include "comm/store_fingerprint_exchange.h"
#include "comm/work_result.h"
#include "torch/csrc/distributed/c10d/PrefixStore.hpp"
#include "torch/csrc/distributed/c10d/ProcessGroupGloo.hpp"

namespace fsdp {
namespace {

// NOTE [Gloo algorithms]
// Every operation but broadcast rides on one Gloo primitive, all-to-all of
// byte views (Gloo rejects bfloat16 but moves uint8), which writes straight
// into the destination and whose traffic is optimal for both directions:
//   reduce-scatter: send the input as it is (chunk r goes to rank r), then
//     sum the W received chunks here, where 16-bit types can accumulate in
//     float32 (ReduceChunks);
//   all-gather: send W copies of the input (copy r goes to rank r) and
//     receive the output in place.
// Measured on 2 cores over loopback (collectives_benchmark_results.md), this
// beats the all-reduce fallbacks at every size from 1 KiB to 64 MiB, and it
// beats c10d's Gloo all-gather, which allocates, fills and copies out a
// flat buffer on every call (up to 3x slower at 64 MiB). All-reduce of
// float32/float64 stays on Gloo's pipelined ring: the same all-to-all
// composite (reduce-scatter, then all-gather) won below 1 MiB but lost by
// 15-40% at 16-64 MiB; 16-bit all-reduce uses the composite, since Gloo
// cannot reduce bfloat16 and would accumulate float16 in float16. Both staging
// buffers (the all-gather's send, the reduce-scatter's receive) are reused
// across calls: first-touching a fresh 64 MiB buffer costs more here than
// the reduction itself.

at::Tensor AsBytes(const at::Tensor& t) { return t.view({-1}).view(at::kByte); }

bool IsHalfPrecision(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// A staging buffer that is handed out again once no pending work holds it.
// The collectives of one FSDP unit repeat every step with the same sizes;
// the price is one buffer as large as the largest request, kept for the
// group's life (GlooOptions::reuse_staging_buffers turns it off). Thread-safe (a float16 all-reduce takes its second buffer on
// the waiting thread).
class BufferCache {
 public:
  explicit BufferCache(bool enabled) : enabled_(enabled) {}

  // A buffer shaped like `like`; a fresh one when the cached one is in use
  // or caching is off.
  at::Tensor Get(const at::Tensor& like) {
    if (!enabled_) return at::empty_like(like);
    const int64_t bytes = like.nbytes();
    std::lock_guard<std::mutex> lock(mu_);
    if (cached_.defined() && cached_.storage().use_count() > 1) {
      return at::empty_like(like);  // A pending work still reads or writes it.
    }
    if (!cached_.defined() || cached_.numel() < bytes) {
      cached_ = at::Tensor();  // Free the old buffer before allocating.
      cached_ = at::empty({bytes}, at::kByte);
    }
    return cached_.narrow(0, 0, bytes).view(like.scalar_type()).view(like.sizes());
  }

 private:
  const bool enabled_;
  std::mutex mu_;
  at::Tensor cached_;  // Bytes.
};

// Elements reduced per step: small enough that a segment of every chunk
// stays in cache, large enough to amortize the per-call overhead of ATen.
constexpr int64_t kReduceSegment = 1 << 18;

// output = op over r of chunk r of `received` (W >= 2 equal chunks of
// output.numel() elements). Sums run left to right over ranks, segment by
// segment, straight into `output`: no buffer as large as the input is
// allocated (on this class of machine, first-touching a fresh 64 MiB buffer
// costs more than the reduction). 16-bit inputs accumulate in float32
// through two per-thread scratch segments.
void ReduceChunks(const at::Tensor& output, const at::Tensor& received, int world,
                  ReduceOp op) {
  const int64_t n = output.numel();
  at::Tensor chunks = received.view({world, n});
  thread_local at::Tensor accumulator;
  thread_local at::Tensor converted;
  const bool half = IsHalfPrecision(output);
  if (half && !accumulator.defined()) {
    accumulator = at::empty({kReduceSegment}, at::kFloat);
    converted = at::empty({kReduceSegment}, at::kFloat);
  }
  for (int64_t begin = 0; begin < n; begin += kReduceSegment) {
    const int64_t len = std::min(kReduceSegment, n - begin);
    at::Tensor out = output.narrow(0, begin, len);
    auto chunk = [&](int r) { return chunks.select(0, r).narrow(0, begin, len); };
    if (!half) {
      at::add_out(out, chunk(0), chunk(1));
      for (int r = 2; r < world; ++r) out.add_(chunk(r));
      if (op == ReduceOp::kAvg) out.div_(world);
      continue;
    }
    at::Tensor acc = accumulator.narrow(0, 0, len);
    at::Tensor tmp = converted.narrow(0, 0, len);
    acc.copy_(chunk(0));
    for (int r = 1; r < world; ++r) {
      tmp.copy_(chunk(r));
      acc.add_(tmp);
    }
    if (op == ReduceOp::kAvg) acc.div_(world);
    out.copy_(acc);
  }
}

// One c10d work plus what must run on the waiting thread once it completes.
// `finish` may issue and wait for further collectives (the second phase of a
// float16 all-reduce).
class GlooWork final : public CollectiveWork {
 public:
  GlooWork(std::string what, c10::intrusive_ptr<c10d::Work> work,
           std::function<void()> finish)
      : what_(std::move(what)), work_(std::move(work)), finish_(std::move(finish)) {}

  ~GlooWork() override {
    if (result_.done()) return;
    try {
      Wait();
    } catch (...) {
      // Destructors cannot throw; the caller chose not to wait for the error.
    }
  }

  void Wait() override {
    result_.Wait([this] {
      std::string error = ErrorMessageOf([this] { work_->wait(); });
      if (!error.empty()) error = absl::StrCat(what_, " failed: ", error);
      work_.reset();  // c10d's work holds the staging buffers too.
      if (error.empty() && finish_) error = ErrorMessageOf(finish_);
      finish_ = nullptr;  // Releases the staging buffers it held.
      return error;
    });
  }

 private:
  std::string what_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  WorkResult result_;
};

// NOTE [Collective headers]
// Gloo ends the process when a peer sends more bytes than a receive expects
// (an enforce that throws on its I/O thread), and silently mixes data when
// ranks issue different collectives of equal size. So before every
// collective the ranks all-gather a fixed-size header (sequence number,
// operation, element count, root or reduce op, and the rolling hash of the
// whole history, labels included: comm/fingerprint.h) and go on only if all
// headers agree; otherwise every rank's collective fails at once, nothing
// is sent, and the failure's explanation names where the histories parted.
// The price is one 40-byte all-to-all per collective
// (GlooOptions::check_collective_headers; measured in
// collectives_benchmark_results.md).
constexpr int kHeaderFields = 5;

// NOTE [Concurrent enqueues]. ProcessGroupGloo records every collective it
// enqueues in c10d's flight recorder, one per process. In libtorch 2.8 to
// 2.11, FlightRecorder::recordWithResetEnabled looks a group's id up in a
// std::map, and inserts it on the group's first collective, before it takes
// the recorder's mutex (FlightRecorderDetail.hpp). Two process groups of one
// process that enqueue at once from two threads race on that map: a segfault
// in std::_Rb_tree_insert_and_rebalance under ProcessGroupGloo::enqueue.
// libtorch 2.12 and later take the mutex first; 1.13 has no recorder. Ranks
// run as threads do this, as would a hybrid layout's two groups driven from
// two threads. Every call that enqueues on a ProcessGroupGloo holds this
// process-wide mutex instead: enqueueing only queues the work, so it is held
// for microseconds, and the recorder stays on (TORCH_FR_BUFFER_SIZE=0, the
// other way out, would turn it off). Regression test:
// Collectives.ManyGroupsOfOneProcessStartTheirFirstCollectivesAtOnce.
std::mutex& EnqueueMutex() {
  static std::mutex* const mutex = new std::mutex();
  return *mutex;
}

class GlooCollectives final : public Collectives {
 public:
  GlooCollectives(int rank, int world_size, const GlooOptions& options,
                  c10::intrusive_ptr<c10d::ProcessGroupGloo> group)
      : Collectives(rank, world_size),
        group_name_(options.group_name),
        check_headers_(options.check_collective_headers),
        group_(std::move(group)),
        send_cache_(options.reuse_staging_buffers),
        receive_cache_(options.reuse_staging_buffers) {}

 protected:
  std::unique_ptr<CollectiveWork> DoAllGather(const at::Tensor& output,
                                              const at::Tensor& input) override {
    std::string what = What("all-gather", output);
    if (auto failed = AgreeOnHeader(what)) return failed;
    return StartAllGather(std::move(what), output, input);
  }

  std::unique_ptr<CollectiveWork> DoReduceScatter(const at::Tensor& output,
                                                  const at::Tensor& input,
                                                  ReduceOp op) override {
    if (auto failed = AgreeOnHeader(What("reduce-scatter", input))) return failed;
    at::Tensor received = receive_cache_.Get(input);
    auto work = StartAllToAll(received, input);
    const int world = world_size();
    return std::make_unique<GlooWork>(
        What("reduce-scatter", input), std::move(work),
        [output, received, op, world] { ReduceChunks(output, received, world, op); });
  }

  std::unique_ptr<CollectiveWork> DoAllReduce(const at::Tensor& tensor,
                                              ReduceOp op) override {
    if (auto failed = AgreeOnHeader(What("all-reduce", tensor))) return failed;
    if (!IsHalfPrecision(tensor)) {
      std::vector<at::Tensor> tensors = {tensor};
      c10d::AllreduceOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      auto work = Enqueue([&](c10d::ProcessGroupGloo& g) { return g.allreduce(tensors, options); });
      const int world = world_size();
      return std::make_unique<GlooWork>(What("all-reduce", tensor), std::move(work),
                                        [tensor, op, world] {
                                          if (op == ReduceOp::kAvg) tensor.div_(world);
                                        });
    }
    // Reduce-scatter then all-gather over a buffer padded to a multiple of W.
    const int64_t world = world_size();
    const int64_t numel = tensor.numel();
    const int64_t chunk = (numel + world - 1) / world;
    const bool padded = chunk * world != numel;
    at::Tensor flat = tensor.view({-1});
    at::Tensor send = flat;
    if (padded) {
      send = at::zeros({chunk * world}, tensor.options());
      send.narrow(0, 0, numel).copy_(flat);
    }
    at::Tensor received = receive_cache_.Get(send);
    auto work = StartAllToAll(received, send);
    std::string what = What("all-reduce", tensor);
    return std::make_unique<GlooWork>(
        what, std::move(work), [this, what, flat, send, received, op, chunk, padded] {
          at::Tensor shard = at::empty({chunk}, flat.options());
          ReduceChunks(shard, received, world_size(), op);
          // `send` is free again: gather the reduced shards into it, or
          // straight into the caller's tensor when no padding was needed.
          at::Tensor gathered = padded ? send : flat;
          StartAllGather(what + " (all-gather phase)", gathered, shard)->Wait();
          if (padded) flat.copy_(gathered.narrow(0, 0, flat.numel()));
        });
  }

  std::unique_ptr<CollectiveWork> DoBroadcast(const at::Tensor& tensor,
                                              int root) override {
    if (auto failed = AgreeOnHeader(What("broadcast", tensor))) return failed;
    std::vector<at::Tensor> tensors = {AsBytes(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.rootTensor = 0;
    auto work = Enqueue([&](c10d::ProcessGroupGloo& g) { return g.broadcast(tensors, options); });
    return std::make_unique<GlooWork>(What("broadcast", tensor), std::move(work), nullptr);
  }

  std::unique_ptr<CollectiveWork> DoAllToAll(const at::Tensor& output,
                                             const at::Tensor& input) override {
    if (auto failed = AgreeOnHeader(What("all-to-all", input))) return failed;
    return std::make_unique<GlooWork>(What("all-to-all", input), StartAllToAll(output, input),
                                      nullptr);
  }

  void DoBarrier() override {
    const std::string what = absl::StrCat(Describe(), " of group '", group_name_, "': barrier");
    if (auto failed = AgreeOnHeader(what)) failed->Wait();
    GlooWork work(what, Enqueue([](c10d::ProcessGroupGloo& g) {
                    return g.barrier(c10d::BarrierOptions());
                  }),
                  nullptr);
    work.Wait();
  }

 private:
  // NOTE [Collective headers]. Null when every rank's header matches this
  // one; else a work that fails with what differed.
  std::unique_ptr<CollectiveWork> AgreeOnHeader(const std::string& what) {
    if (!check_headers_) return nullptr;
    const CollectiveRecord record = fingerprints().Last();
    const int world = world_size();
    at::Tensor send = at::empty({world, kHeaderFields}, at::kLong);
    const int64_t header[kHeaderFields] = {record.seq, static_cast<int64_t>(record.op),
                                           record.numel, record.argument,
                                           static_cast<int64_t>(record.hash)};
    for (int r = 0; r < world; ++r) {
      std::memcpy(send[r].data_ptr<int64_t>(), header, sizeof(header));
    }
    at::Tensor received = at::empty({world, kHeaderFields}, at::kLong);
    try {
      StartAllToAll(received, send)->wait();
    } catch (const std::exception& e) {
      const std::string error = e.what();
      return MakeFailedWork(absl::StrCat(
          what, " failed: while agreeing on its header: ", error.substr(0, error.find('\n'))));
    }
    std::vector<std::string> differing;
    for (int r = 0; r < world; ++r) {
      const int64_t* theirs = received[r].data_ptr<int64_t>();
      if (std::equal(header, header + kHeaderFields, theirs)) continue;
      const bool known_op = theirs[1] >= 0 && theirs[1] < kNumCollectiveOps;
      // The hash covers labels and all earlier collectives: when only it
      // differs, the explanation below says where.
      const bool only_hash = std::equal(header, header + kHeaderFields - 1, theirs);
      differing.push_back(absl::StrCat(
          "rank ", r, " issued #", theirs[0], " ",
          known_op ? CollectiveOpName(static_cast<CollectiveOp>(theirs[1])) : "(unknown op)",
          " of ", theirs[2], " elements",
          only_hash ? " with another unit or phase, or after other collectives" : ""));
    }
    if (differing.empty()) return nullptr;
    return MakeFailedWork(absl::StrCat(
        what, " failed: the ranks issued different collectives here (nothing was sent): "
        "this rank issued ", DescribeRecord(record), "; ", absl::StrJoin(differing, "; ")));
  }

  // All-gather as an all-to-all of W copies of the input (NOTE [Gloo
  // algorithms]); the send buffer stays referenced until the work is waited.
  std::unique_ptr<CollectiveWork> StartAllGather(std::string what, const at::Tensor& output,
                                                 const at::Tensor& input) {
    at::Tensor send = send_cache_.Get(output);
    const int64_t n = input.numel();
    for (int r = 0; r < world_size(); ++r) send.narrow(0, r * n, n).copy_(input);
    auto work = StartAllToAll(output, send);
    return std::make_unique<GlooWork>(std::move(what), std::move(work), [send] {});
  }

  c10::intrusive_ptr<c10d::Work> StartAllToAll(const at::Tensor& received,
                                               const at::Tensor& send) {
    at::Tensor received_bytes = AsBytes(received);
    at::Tensor send_bytes = AsBytes(send);
    std::vector<int64_t> equal_splits;  // Empty: W equal chunks.
    return Enqueue([&](c10d::ProcessGroupGloo& g) {
      return g.alltoall_base(received_bytes, send_bytes, equal_splits, equal_splits);
    });
  }

  // Every call that enqueues work on group_ goes through here: NOTE
  // [Concurrent enqueues].
  template <typename Start>
  c10::intrusive_ptr<c10d::Work> Enqueue(Start&& start) {
    std::lock_guard<std::mutex> lock(EnqueueMutex());
    return start(*group_);
  }

  std::string What(const char* op, const at::Tensor& full) const {
    return absl::StrCat(Describe(), " of group '", group_name_, "': ", op, " of ",
                        full.numel(), " ", c10::toString(full.scalar_type()),
                        " elements");
  }

  const std::string group_name_;
  const bool check_headers_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  BufferCache send_cache_;     // All-gather inputs, W copies.
  BufferCache receive_cache_;  // Reduce-scatter (and 16-bit all-reduce) inputs.
};

// Before Gloo connects, every rank announces its view of the group in the
// store and checks the others': ranks that disagree on the world size, or
// two processes claiming one rank, would otherwise wait for each other until
// the timeout and fail with a transport error that says neither.
constexpr int kConnectAttempts = 3;

// NOTE [Broken connections]. Gloo sends with writev(2), which cannot take
// MSG_NOSIGNAL: a write to a peer that has closed its end (a rank that
// failed, exited or lost its node) raises SIGPIPE, whose default action
// kills this process before the error reaches the rank's report, so a
// survivor dies silently instead of naming the lost rank. Python never
// sees this: it ignores SIGPIPE at startup. A no-op handler rather than
// SIG_IGN: an ignored disposition survives exec(2) into child processes, a
// handler does not. A handler the program installed itself is left alone.
// Checked at every group's creation; two racing creations install the same
// handler.
void SurviveBrokenConnections() {
  struct sigaction current = {};
  if (sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
  struct sigaction survive = {};
  survive.sa_handler = [](int) {};
  survive.sa_flags = SA_RESTART;
  sigemptyset(&survive.sa_mask);
  sigaction(SIGPIPE, &survive, nullptr);
}

absl::Status CheckMembership(c10d::Store& store, int rank, int world_size,
                             const std::string& who) {
  const std::string mine = std::to_string(world_size);
  if (store.add(absl::StrCat("joined/", rank), 1) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": another process already joined as rank ", rank));
  }
  store.set(absl::StrCat("world_size/", rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    const std::vector<uint8_t> theirs = store.get(absl::StrCat("world_size/", peer));
    if (std::string(theirs.begin(), theirs.end()) != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": world size mismatch: this rank was created with world size ",
          world_size, " but rank ", peer, " was created with world size ",
          std::string(theirs.begin(), theirs.end())));
    }
  }
  return absl::OkStatus();
}

// Gloo would fail later, and less clearly, on any of these.
absl::Status ValidateGlooArguments(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                   int world_size, const GlooOptions& options) {
  if (!store) return absl::InvalidArgumentError("CreateGlooCollectives: store is null");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateGlooCollectives: rank ", rank, " is not in [0, world_size = ", world_size,
        ")"));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateGlooCollectives: threads must be >= 1, got ", options.threads));
  }
  if (options.timeout.count() <= 0) {
    return absl::InvalidArgumentError("CreateGlooCollectives: timeout must be positive");
  }
  if (!options.interface.empty() && !options.hostname.empty()) {
    return absl::InvalidArgumentError(
        "CreateGlooCollectives: set at most one of interface and hostname");
  }
  return absl::OkStatus();
}

// One attempt at this rank's side of the full mesh, under the prefix
// "mesh/<attempt>"; null with `error` set (its first line) when it failed.
c10::intrusive_ptr<c10d::ProcessGroupGloo> TryConnectMesh(
    const c10::intrusive_ptr<c10d::PrefixStore>& prefixed, int attempt, int rank, int world_size,
    const GlooOptions& options, std::string& error) {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  // A fresh device (listener) per attempt: one that saw a failed mesh
  // may hold its stale connections.
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  if (!options.interface.empty()) {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForInterface(options.interface));
  } else if (!options.hostname.empty()) {
    gloo_options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  gloo_options->threads = options.threads;
  try {
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("mesh/", attempt), prefixed),
        rank, world_size, gloo_options);
  } catch (const std::exception& e) {
    error = e.what();
    error = error.substr(0, error.find('\n'));  // c10::Error appends a backtrace.
    // Close this rank's listener now: peers still connecting to it fail
    // at once instead of waiting on a mesh that will never form.
    gloo_options.reset();
  }
  return group;
}

// Posts whether this rank connected at `attempt` and waits for every
// peer's word; returns the ranks that did not connect. Throws naming the
// ranks that never reported.
std::vector<int> ExchangeMeshResults(c10d::PrefixStore& prefixed, int attempt, int rank,
                                     int world_size, const GlooOptions& options,
                                     const std::string& error) {
  const std::string result = error.empty() ? "ok" : "failed";
  prefixed.set(absl::StrCat("mesh/", attempt, "/result/", rank),
               std::vector<uint8_t>(result.begin(), result.end()));
  // A peer reports only after its own attempt ends, which may take the
  // whole connection timeout; wait for that and a margin.
  std::vector<std::string> result_keys;
  for (int peer = 0; peer < world_size; ++peer) {
    result_keys.push_back(absl::StrCat("mesh/", attempt, "/result/", peer));
  }
  try {
    prefixed.wait(result_keys, 2 * options.timeout + std::chrono::seconds(5));
  } catch (const std::exception&) {
    std::vector<int> silent;
    for (int peer = 0; peer < world_size; ++peer) {
      if (!prefixed.check({result_keys[peer]})) silent.push_back(peer);
    }
    throw std::runtime_error(absl::StrCat(
        "rank(s) ", absl::StrJoin(silent, ", "), " never finished connecting",
        error.empty() ? "" : absl::StrCat("; this rank: ", error)));
  }
  std::vector<int> failed;
  for (int peer = 0; peer < world_size; ++peer) {
    const std::vector<uint8_t> theirs =
        prefixed.get(absl::StrCat("mesh/", attempt, "/result/", peer));
    if (std::string(theirs.begin(), theirs.end()) != "ok") failed.push_back(peer);
  }
  return failed;
}

// Gloo 1.13 occasionally drops a connection while a full mesh forms
// under load ("Connection closed by peer" on one rank while the others
// connect). Every rank reports through the store whether it connected;
// if any did not, all of them build the mesh again under a fresh prefix.
// Throws when no attempt connects every rank.
std::unique_ptr<Collectives> ConnectMeshWithRetries(
    const c10::intrusive_ptr<c10d::PrefixStore>& prefixed, int rank, int world_size,
    const GlooOptions& options) {
  std::string last_error;
  for (int attempt = 0; attempt < kConnectAttempts; ++attempt) {
    std::string error;
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group =
        TryConnectMesh(prefixed, attempt, rank, world_size, options, error);
    const std::vector<int> failed =
        ExchangeMeshResults(*prefixed, attempt, rank, world_size, options, error);
    if (failed.empty()) {
      auto collectives = std::unique_ptr<Collectives>(
          new GlooCollectives(rank, world_size, options, std::move(group)));
      if (options.exchange_fingerprints) {
        collectives->AttachFingerprintExchange(
            MakeStoreFingerprintExchange(prefixed, "fingerprints", rank, world_size),
            options.fingerprints);
      }
      return collectives;
    }
    last_error = error.empty()
                     ? absl::StrCat("rank(s) ", absl::StrJoin(failed, ", "), " failed to connect")
                     : error;
  }
  throw std::runtime_error(absl::StrCat("after ", kConnectAttempts, " attempts: ", last_error));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collectives>> CreateGlooCollectives(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    const GlooOptions& options) {
  FSDP_RETURN_IF_ERROR(ValidateGlooArguments(store, rank, world_size, options));
  const std::string who = absl::StrCat("rank ", rank, " of ", world_size, " of group '",
                                       options.group_name, "'");
  SurviveBrokenConnections();
  try {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        absl::StrCat("fsdp/", options.group_name), std::move(store));
    prefixed->setTimeout(options.timeout);
    FSDP_RETURN_IF_ERROR(CheckMembership(*prefixed, rank, world_size, who));
    return ConnectMeshWithRetries(prefixed, rank, world_size, options);
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(),
                        absl::StrCat(who, ": could not connect the group within ",
                                     options.timeout.count(), " ms: ", cause.message()));
  }
}

GroupConnector GlooGroupConnector(c10::intrusive_ptr<c10d::Store> store, GlooOptions options) {
  return [store = std::move(store), options = std::move(options)](
             const std::string& group_name, int rank,
             int size) -> absl::StatusOr<std::unique_ptr<Collectives>> {
    GlooOptions group_options = options;
    group_options.group_name = group_name;
    return CreateGlooCollectives(store, rank, size, group_options);
  };
}

}  // namespace fsdp
