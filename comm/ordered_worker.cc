#include "comm/ordered_worker.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace internal {

struct OrderedJob {
  std::function<void()> body;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;  // Empty when the job succeeded.

  void Finish(std::string failure) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      error = std::move(failure);
    }
    cv.notify_all();
  }
  // The error, empty on success.
  std::string AwaitDone() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    return error;
  }
};

}  // namespace internal

namespace {

using internal::OrderedJob;

class OrderedWork final : public CollectiveWork {
 public:
  explicit OrderedWork(std::shared_ptr<OrderedJob> job) : job_(std::move(job)) {}
  // An unwaited work waits for its job (see CollectiveWork).
  ~OrderedWork() override { job_->AwaitDone(); }

  void Wait() override {
    const std::string error = job_->AwaitDone();
    TORCH_CHECK(error.empty(), error);
  }

 private:
  std::shared_ptr<OrderedJob> job_;
};

}  // namespace

OrderedWorker::OrderedWorker(std::string describe,
                             std::function<std::shared_ptr<void>()> thread_setup)
    : describe_(std::move(describe)) {
  thread_ =
      std::thread([this, setup = std::move(thread_setup)]() mutable { Run(std::move(setup)); });
}

OrderedWorker::~OrderedWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::unique_ptr<CollectiveWork> OrderedWorker::Enqueue(std::function<void()> body) {
  auto job = std::make_shared<OrderedJob>();
  job->body = std::move(body);
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, describe_, ": the group is being destroyed");
    jobs_.push_back(job);
  }
  cv_.notify_all();
  return std::make_unique<OrderedWork>(std::move(job));
}

void OrderedWorker::Fail(const std::string& failure) {
  std::lock_guard<std::mutex> lock(mu_);
  if (first_failure_.empty()) {
    first_failure_ = failure.empty() ? absl::StrCat(describe_, ": a collective failed") : failure;
  }
}

void OrderedWorker::Run(std::function<std::shared_ptr<void>()> thread_setup) {
  const std::shared_ptr<void> setup = thread_setup ? thread_setup() : nullptr;
  for (;;) {
    std::shared_ptr<OrderedJob> job;
    std::string first_failure;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
      first_failure = first_failure_;
    }
    if (!first_failure.empty()) {
      job->body = nullptr;
      job->Finish(absl::StrCat(describe_,
                               ": not run: an earlier collective of this group "
                               "failed: ",
                               first_failure));
      continue;
    }
    std::string failure;
    try {
      // Destroyed before the job counts as done: the tensors it holds are
      // released by then.
      const std::function<void()> body = std::move(job->body);
      body();
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
      if (failure.empty()) failure = absl::StrCat(describe_, ": a collective failed");
    } catch (const std::exception& e) {
      failure = e.what();
      if (failure.empty()) failure = absl::StrCat(describe_, ": a collective failed");
    } catch (...) {
      failure = absl::StrCat(describe_, ": a collective threw a non-standard exception");
    }
    if (!failure.empty()) Fail(failure);
    job->Finish(std::move(failure));
  }
}

}  // namespace fsdp
