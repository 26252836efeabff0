#include "fsdp/runtime_streams.h"

#include <utility>

#include "c10/core/impl/VirtualGuardImpl.h"

namespace fsdp {

RuntimeStreams::RuntimeStreams(c10::Device device)
    : asynchronous_(DeviceHasStreams(device.type())),
      compute_(c10::impl::VirtualGuardImpl(device.type()).getStream(device)),
      all_gather_(compute_),
      reduce_scatter_(compute_) {
  if (!asynchronous_) return;
  c10::impl::VirtualGuardImpl guard(device.type());
  all_gather_ = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  reduce_scatter_ = guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

void RuntimeStreams::WaitStream(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;
  DeviceEvent::RecordOn(producer).BlockStream(waiter);
}

void AllGatherRateLimiter::OnReshard(DeviceEvent freed) {
  if (max_in_flight_ <= 0) return;
  free_events_.push_back(std::move(freed));
}

void AllGatherRateLimiter::BeforeAllGather() {
  if (max_in_flight_ <= 0) return;
  while (static_cast<int>(free_events_.size()) >= max_in_flight_) {
    DeviceEvent oldest = std::move(free_events_.front());
    free_events_.pop_front();
    if (!oldest.Query()) {
      ++host_waits_;
      oldest.Synchronize();
    }
  }
}

}  // namespace fsdp
