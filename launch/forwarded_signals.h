// The signals a launcher forwards to its ranks (SIGINT, SIGTERM, SIGHUP,
// SIGQUIT), recorded process-wide while a ForwardedSignalScope is alive, so
// that any of the launcher's threads can stop waiting when one arrives.
// Private to the local_launcher target.
#ifndef FSDP_LAUNCH_FORWARDED_SIGNALS_H_
#define FSDP_LAUNCH_FORWARDED_SIGNALS_H_

#include <signal.h>

#include <iterator>

namespace fsdp::launch_internal {

inline constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

// Records kForwardedSignals while alive (forgetting any received before);
// restores the previous handlers after. The handlers are process-wide: one
// scope at a time.
class ForwardedSignalScope {
 public:
  ForwardedSignalScope();
  ~ForwardedSignalScope();
  ForwardedSignalScope(const ForwardedSignalScope&) = delete;
  ForwardedSignalScope& operator=(const ForwardedSignalScope&) = delete;

 private:
  struct sigaction previous_[std::size(kForwardedSignals)];
};

// The first signal received in the current scope; 0 when none.
int FirstForwardedSignal();

// How many have been received, and the last: a wait that began after the
// first tells a new one by the count.
int ForwardedSignalCount();
int LastForwardedSignal();

}  // namespace fsdp::launch_internal

#endif  // FSDP_LAUNCH_FORWARDED_SIGNALS_H_
