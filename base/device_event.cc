#include "base/device_event.h"

#include <chrono>
#include <thread>

#include "torch/version.h"

namespace fsdp {

bool DeviceHasStreams(c10::DeviceType type) {
  return type != c10::DeviceType::CPU && type != c10::DeviceType::Meta;
}

DeviceEvent DeviceEvent::RecordOn(const c10::Stream& stream) {
  DeviceEvent event;
  if (!DeviceHasStreams(stream.device_type())) return event;
  event.event_ = std::make_unique<c10::Event>(stream.device_type());
  event.event_->record(stream);
  return event;
}

bool DeviceEvent::Query() const { return event_ == nullptr || event_->query(); }

void DeviceEvent::BlockStream(const c10::Stream& stream) const {
  if (event_ != nullptr) event_->block(stream);
}

void DeviceEvent::Synchronize() const {
  if (event_ == nullptr) return;
#if TORCH_VERSION_MAJOR >= 2
  event_->synchronize();
#else
  // libtorch 1.x's c10::Event has no host wait.
  while (!event_->query()) std::this_thread::sleep_for(std::chrono::microseconds(20));
#endif
}

}  // namespace fsdp
