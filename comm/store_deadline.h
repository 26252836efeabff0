// Store operations that give up at a deadline.
//
// c10d's TCPStore client waits for its server's answer with no limit in
// libtorch 2.x (check, add, get's reply; 1.13 bounded them by the store's
// timeout): when the server's host is cut off, the call never returns.
// Code that must end on its own while the job falls apart (a rank
// explaining a failed collective, a launcher watching the others) calls
// the store through a DeadlineStore: each call runs on a helper thread and
// is abandoned at its deadline. Once one call has been abandoned the store
// counts as unreachable for good, and later calls fail at once: the
// abandoned call may still be answered, and the connection is no longer in
// step with its server. The abandoned helper keeps the c10d store object
// (and, in libtorch 2.x, its client's lock): anything else that shares that
// object blocks on it too, so a store given to a DeadlineStore is used
// through it alone once a failure is being handled.
//
// This is an adapter file: c10d's types appear only in comm's adapters.
#ifndef FSDP_COMM_STORE_DEADLINE_H_
#define FSDP_COMM_STORE_DEADLINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "torch/csrc/distributed/c10d/Store.hpp"

namespace fsdp {

// Thrown when a store did not answer by the deadline, or had not before.
class StoreUnreachable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class DeadlineStore {
 public:
  // `name` says which store in messages ("the store at node0:29500").
  DeadlineStore(c10::intrusive_ptr<c10d::Store> store, std::string name)
      : store_(std::move(store)), name_(std::move(name)) {}

  // op(store)'s result, or its exception; StoreUnreachable when it has not
  // returned within `timeout`. Calls must not overlap.
  template <typename Op>
  auto Call(Op op, std::chrono::milliseconds timeout) -> std::invoke_result_t<Op, c10d::Store&> {
    using Result = std::invoke_result_t<Op, c10d::Store&>;
    if (unreachable_.load()) {
      throw StoreUnreachable(name_ + " stopped answering before (an earlier call gave up)");
    }
    struct Outcome {
      std::mutex mu;
      std::condition_variable done_cv;
      bool done = false;
      std::exception_ptr error;
      std::optional<std::conditional_t<std::is_void_v<Result>, bool, Result>> value;
    };
    auto outcome = std::make_shared<Outcome>();
    // The helper owns what it uses: when abandoned, it may outlive this
    // object.
    std::thread([store = store_, op = std::move(op), outcome]() mutable {
      std::exception_ptr error;
      try {
        if constexpr (std::is_void_v<Result>) {
          op(*store);
          outcome->value = true;
        } else {
          outcome->value = op(*store);
        }
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(outcome->mu);
      // Moved, not copied: no reference to the exception stays here.
      outcome->error = std::move(error);
      outcome->done = true;
      outcome->done_cv.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lock(outcome->mu);
    if (!outcome->done_cv.wait_for(lock, timeout, [&] { return outcome->done; })) {
      unreachable_.store(true);
      throw StoreUnreachable(name_ + " did not answer within " + std::to_string(timeout.count()) +
                             " ms");
    }
    // Taken out, so that the exception is freed on this thread: libstdc++
    // counts its references where ThreadSanitizer cannot see.
    if (std::exception_ptr error = std::move(outcome->error)) std::rethrow_exception(error);
    if constexpr (!std::is_void_v<Result>) return std::move(*outcome->value);
  }

  bool unreachable() const { return unreachable_.load(); }
  const std::string& name() const { return name_; }

 private:
  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string name_;
  std::atomic<bool> unreachable_{false};
};

}  // namespace fsdp

#endif  // FSDP_COMM_STORE_DEADLINE_H_
