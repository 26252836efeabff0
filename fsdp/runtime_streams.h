// The streams the FSDP runtime orders its work on, and the all-gather rate
// limiter, through libtorch's device-generic c10 types (c10::Stream,
// c10::Event, c10::impl::VirtualGuardImpl): the runtime never names a
// device, so the code that runs on CPU today is the code that runs on CUDA.
//
// On a device with streams (CUDA):
//   compute         the thread's current stream when the model was wrapped;
//   all_gather      a high-priority pool stream: unshards are issued there
//                   and compute waits on an event recorded after them;
//   reduce_scatter  a pool stream: it waits on compute before gradients are
//                   reduced, and compute waits on it at the end of backward.
// On CPU (and Meta) work is synchronous on the calling thread: all three
// are the current stream and events are complete at once (c10's CPU guard
// has no events), so every wait below is free.
//
// Rate limiter (PyTorch's limit_all_gathers): every reshard records a *free
// event* on compute; before issuing an all-gather, the runtime waits on the
// host for the oldest free event once `max_in_flight` are outstanding. This
// keeps the host from issuing all-gathers faster than the device frees
// full parameters, which would otherwise let full parameters of many units
// be allocated at once.
#ifndef FSDP_FSDP_RUNTIME_STREAMS_H_
#define FSDP_FSDP_RUNTIME_STREAMS_H_

#include <cstdint>
#include <deque>
#include <memory>

#include "base/device_event.h"
#include "c10/core/Device.h"
#include "c10/core/Stream.h"

namespace fsdp {

class RuntimeStreams {
 public:
  explicit RuntimeStreams(c10::Device device);

  const c10::Stream& compute() const { return compute_; }
  const c10::Stream& all_gather() const { return all_gather_; }
  const c10::Stream& reduce_scatter() const { return reduce_scatter_; }
  bool asynchronous() const { return asynchronous_; }

  // `waiter` waits for the work issued on `producer` so far; no-op when they
  // are the same stream.
  static void WaitStream(const c10::Stream& waiter, const c10::Stream& producer);

 private:
  bool asynchronous_;
  c10::Stream compute_;
  c10::Stream all_gather_;
  c10::Stream reduce_scatter_;
};

class AllGatherRateLimiter {
 public:
  // max_in_flight <= 0 disables the limiter.
  explicit AllGatherRateLimiter(int max_in_flight) : max_in_flight_(max_in_flight) {}

  // After freeing a unit's full parameters: `freed` completes when the
  // device has finished using them.
  void OnReshard(DeviceEvent freed);
  // Before issuing an all-gather: waits on the host for the oldest free
  // event if max_in_flight are outstanding.
  void BeforeAllGather();

  int64_t host_waits() const { return host_waits_; }  // Times BeforeAllGather waited.
  size_t outstanding() const { return free_events_.size(); }

 private:
  const int max_in_flight_;
  std::deque<DeviceEvent> free_events_;
  int64_t host_waits_ = 0;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_RUNTIME_STREAMS_H_
