// What the CollectiveWork implementations of comm/ share (an internal
// target: dependents of comm do not see it).
//
// CollectiveWork::Wait's contract (comm/collectives.h) is that the first
// call waits for the work and every later call repeats its outcome: a work
// that failed stays failed, since its output is not valid. WorkResult is
// that contract, once, for the works that keep state across Wait calls
// (ExplainedWork in collectives.cc, GlooWork in gloo_collectives.cc).
// ErrorMessageOf turns the error a wait throws into the message a work
// keeps and rethrows, without c10::Error's backtrace.
//
// Not thread-safe: a work is waited on by one thread, as CollectiveWork
// says.
#ifndef FSDP_COMM_WORK_RESULT_H_
#define FSDP_COMM_WORK_RESULT_H_

#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "c10/util/Exception.h"

namespace fsdp {

// Runs `fn`: "" when it returns, else the message of the std::exception it
// throws (a c10::Error's without its backtrace; never empty, so that a
// failure cannot pass for success). Other exceptions propagate.
inline std::string ErrorMessageOf(const std::function<void()>& fn) {
  std::string message;
  try {
    fn();
    return "";
  } catch (const c10::Error& e) {
    message = e.msg();
  } catch (const std::exception& e) {
    message = e.what();
  }
  return message.empty() ? "an exception without a message" : message;
}

// The outcome of a work's first Wait, kept for the later ones.
class WorkResult {
 public:
  // Whether the first Wait ran (an unwaited work's destructor still waits).
  bool done() const { return done_; }

  // On the first call only, runs `wait`, which waits for the work, releases
  // what the work held and returns the work's error ("" when it
  // succeeded). Then, on every call, throws c10::Error with that error if
  // there was one. An exception `wait` itself lets escape (explaining a
  // failure failed) propagates, and the work stays failed with its message.
  void Wait(const std::function<std::string()>& wait) {
    if (!done_) {
      done_ = true;
      try {
        error_ = wait();
      } catch (...) {
        error_ = "waiting for the work failed";  // Kept for an exception of no std type.
        error_ = ErrorMessageOf([] { throw; });
        throw;
      }
    }
    TORCH_CHECK(error_.empty(), error_);
  }

 private:
  bool done_ = false;
  std::string error_;
};

}  // namespace fsdp

#endif  // FSDP_COMM_WORK_RESULT_H_
