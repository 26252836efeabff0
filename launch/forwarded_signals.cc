#include "launch/forwarded_signals.h"

#include <atomic>

namespace fsdp::launch_internal {
namespace {

// Lock-free, so that the handler may set them on any thread (the watcher's
// and store helpers' included) while others read them.
std::atomic<int> g_received_signal{0};
std::atomic<int> g_signal_count{0};
std::atomic<int> g_last_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

void RecordSignal(int signal) {
  int none = 0;
  g_received_signal.compare_exchange_strong(none, signal);
  g_last_signal.store(signal);
  g_signal_count.fetch_add(1);
}

}  // namespace

ForwardedSignalScope::ForwardedSignalScope() {
  g_received_signal.store(0);
  struct sigaction action {};
  action.sa_handler = RecordSignal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    ::sigaction(kForwardedSignals[i], &action, &previous_[i]);
  }
}

ForwardedSignalScope::~ForwardedSignalScope() {
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) {
    ::sigaction(kForwardedSignals[i], &previous_[i], nullptr);
  }
}

int FirstForwardedSignal() { return g_received_signal.load(); }
int ForwardedSignalCount() { return g_signal_count.load(); }
int LastForwardedSignal() { return g_last_signal.load(); }

}  // namespace fsdp::launch_internal
