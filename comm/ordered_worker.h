// One thread that runs a group's collectives in the order they were issued,
// for groups built on other groups (comm/staged_collectives.h,
// comm/hierarchical_collectives.h): issuing returns at once, and since
// every rank issues a group's collectives in one order, the inner groups
// see them in that order on every rank too.
//
//   OrderedWorker worker("rank 1 of 4");
//   std::unique_ptr<CollectiveWork> work = worker.Enqueue([=] { ...; inner.Wait(); });
//   work->Wait();  // Throws c10::Error with the job's error.
//
// A job that throws fails its work with the exception's message; every job
// queued after it then fails at once, quoting that message, instead of
// each waiting for its own timeout on a group that is already broken (Fail
// does the same for a failure seen elsewhere). The destructor runs what is
// queued and joins the thread.
#ifndef FSDP_COMM_ORDERED_WORKER_H_
#define FSDP_COMM_ORDERED_WORKER_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/collectives.h"

namespace fsdp {
namespace internal {
struct OrderedJob;  // One queued job (comm/ordered_worker.cc).
}  // namespace internal

class OrderedWorker {
 public:
  // `describe` prefixes the errors ("rank 1 of 4"); `thread_setup`, when
  // given, runs first on the worker thread and its objects live as long as
  // the thread (a device and stream guard).
  explicit OrderedWorker(std::string describe,
                         std::function<std::shared_ptr<void>()> thread_setup = nullptr);
  ~OrderedWorker();
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Queues `job`; the work is done when the job has returned (or thrown).
  // Destroying the work unwaited waits for the job. Throws c10::Error once
  // the worker is being destroyed.
  std::unique_ptr<CollectiveWork> Enqueue(std::function<void()> job);

  // Fails the jobs that have not started, and every later one, quoting
  // `failure`, as if a job had thrown it: for a failure seen outside a job
  // (a collective the job started and another thread waited for). The
  // first failure is the one quoted. Any thread.
  void Fail(const std::string& failure);

 private:
  void Run(std::function<std::shared_ptr<void>()> thread_setup);

  const std::string describe_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<internal::OrderedJob>> jobs_;
  bool stopping_ = false;
  std::string first_failure_;  // Empty while no job has failed.
  std::thread thread_;
};

}  // namespace fsdp

#endif  // FSDP_COMM_ORDERED_WORKER_H_
