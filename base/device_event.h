// Events on c10's device-generic streams, so that code ordering work across
// streams names no device: on CUDA an event is a cudaEvent; on CPU (and
// Meta), where work runs synchronously on the calling thread, there is
// nothing to record and every wait is free (c10's CPU guard has no events).
#ifndef FSDP_BASE_DEVICE_EVENT_H_
#define FSDP_BASE_DEVICE_EVENT_H_

#include <memory>

#include "c10/core/Device.h"
#include "c10/core/Event.h"
#include "c10/core/Stream.h"

namespace fsdp {

// Whether work on `type` runs asynchronously on streams with events.
bool DeviceHasStreams(c10::DeviceType type);

// An event recorded on a stream, or nothing to wait for (host-synchronous
// devices). Move-only.
class DeviceEvent {
 public:
  DeviceEvent() = default;  // Complete.
  // Records the work issued on `stream` so far.
  static DeviceEvent RecordOn(const c10::Stream& stream);

  bool Query() const;
  // Makes work issued on `stream` from now on wait for the event (no host
  // wait).
  void BlockStream(const c10::Stream& stream) const;
  // Waits on the host until the event has completed.
  void Synchronize() const;

 private:
  std::unique_ptr<c10::Event> event_;
};

}  // namespace fsdp

#endif  // FSDP_BASE_DEVICE_EVENT_H_
