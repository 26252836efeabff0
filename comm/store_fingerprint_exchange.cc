#include "comm/store_fingerprint_exchange.h"

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fsdp {
namespace {

class StoreFingerprintExchange final : public FingerprintExchange {
 public:
  StoreFingerprintExchange(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                           int world_size)
      : store_(std::move(store)),
        prefix_(std::move(prefix)),
        rank_(rank),
        world_size_(world_size) {}

  void Publish(const std::string& round, const std::string& report) override {
    store_->set(Key(round, rank_), std::vector<uint8_t>(report.begin(), report.end()));
  }

  std::vector<std::optional<std::string>> Collect(const std::string& round,
                                                  std::chrono::milliseconds timeout) override {
    std::vector<std::optional<std::string>> out(world_size_);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int missing = world_size_;
    while (true) {
      for (int r = 0; r < world_size_; ++r) {
        if (out[r] || !store_->check({Key(round, r)})) continue;
        const std::vector<uint8_t> bytes = store_->get(Key(round, r));
        out[r] = std::string(bytes.begin(), bytes.end());
        --missing;
      }
      if (missing == 0 || std::chrono::steady_clock::now() >= deadline) return out;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void Forget(const std::string& round) override { store_->deleteKey(Key(round, rank_)); }

 private:
  std::string Key(const std::string& round, int rank) const {
    return absl::StrCat(prefix_, "/", round, "/", rank);
  }

  c10::intrusive_ptr<c10d::Store> store_;
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
