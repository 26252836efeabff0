#include "comm/store_fingerprint_exchange.h"

#include <chrono>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/store_deadline.h"

namespace fsdp {
namespace {

// A healthy store answers in milliseconds; one that does not within these
// is taken for unreachable (its host cut off), so that a rank explaining a
// failure ends on its own.
constexpr std::chrono::seconds kWriteTimeout(10);
constexpr std::chrono::seconds kCollectMargin(2);

class StoreFingerprintExchange final : public FingerprintExchange {
 public:
  StoreFingerprintExchange(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                           int world_size)
      : store_(std::move(store), "the store"),
        prefix_(std::move(prefix)),
        rank_(rank),
        world_size_(world_size) {}

  void Publish(const std::string& round, const std::string& report) override {
    store_.Call(
        [key = Key(round, rank_), bytes = std::vector<uint8_t>(report.begin(), report.end())](
            c10d::Store& store) { store.set(key, bytes); },
        kWriteTimeout);
  }

  std::vector<std::optional<std::string>> Collect(const std::string& round,
                                                  std::chrono::milliseconds timeout) override {
    std::vector<std::string> keys;
    for (int r = 0; r < world_size_; ++r) keys.push_back(Key(round, r));
    return store_.Call(
        [keys, timeout](c10d::Store& store) {
          std::vector<std::optional<std::string>> out(keys.size());
          const auto deadline = std::chrono::steady_clock::now() + timeout;
          size_t missing = keys.size();
          while (true) {
            try {
              for (size_t r = 0; r < keys.size(); ++r) {
                if (out[r] || !store.check({keys[r]})) continue;
                const std::vector<uint8_t> bytes = store.get(keys[r]);
                out[r] = std::string(bytes.begin(), bytes.end());
                --missing;
              }
            } catch (const std::exception&) {
              // The rank hosting the store ends once its own wait is over,
              // which can be before ours: the reports read by then are
              // what there is.
              if (missing == keys.size()) throw;
              return out;
            }
            if (missing == 0 || std::chrono::steady_clock::now() >= deadline) return out;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        },
        timeout + kCollectMargin);
  }

  void Forget(const std::string& round) override {
    store_.Call([key = Key(round, rank_)](c10d::Store& store) { store.deleteKey(key); },
                kWriteTimeout);
  }

 private:
  std::string Key(const std::string& round, int rank) const {
    return absl::StrCat(prefix_, "/", round, "/", rank);
  }

  DeadlineStore store_;
  const std::string prefix_;
  const int rank_;
  const int world_size_;
};

}  // namespace

std::shared_ptr<FingerprintExchange> MakeStoreFingerprintExchange(
    c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world_size) {
  return std::make_shared<StoreFingerprintExchange>(std::move(store), std::move(prefix), rank,
                                                    world_size);
}

}  // namespace fsdp
