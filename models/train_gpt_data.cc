#include "models/train_gpt_data.h"

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "formats/torch_file.h"
#include "models/train_gpt_checks.h"
#include "models/train_gpt_flags.h"

namespace train_gpt {
namespace {

// A byte-level corpus with structure to learn: lines of sums, "17+25=42".
std::string MakeCorpus(uint64_t seed, size_t bytes) {
  std::mt19937_64 rng(seed);
  std::string text;
  while (text.size() < bytes) {
    const int a = static_cast<int>(rng() % 100), b = static_cast<int>(rng() % 100);
    text += std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n";
  }
  return text;
}

at::Tensor TokensOf(const std::string& bytes) {
  return at::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                       at::kByte)
      .to(at::kLong);
}

}  // namespace

absl::StatusOr<Corpus> LoadCorpus() {
  Corpus corpus;
  const std::string path = absl::GetFlag(FLAGS_data);
  if (path.empty()) {
    const std::string generated =
        MakeCorpus(absl::GetFlag(FLAGS_seed), kGeneratedCorpusBytes);
    // The generator's bytes as signed chars, folded into 0..255 as before.
    corpus.train = at::from_blob(const_cast<char*>(generated.data()),
                                 {static_cast<int64_t>(generated.size())}, at::kChar)
                       .to(at::kLong)
                       .remainder(256);
    return corpus;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--data=", path, ": cannot open it"));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("--data=", path, ": cannot read it"));
  const at::Tensor tokens = TokensOf(bytes);
  const int64_t held_out = HeldOutBytes(tokens.numel());
  corpus.train = tokens.narrow(0, 0, tokens.numel() - held_out);
  corpus.held_out = tokens.narrow(0, tokens.numel() - held_out, held_out);
  return corpus;
}

TokenSampler::TokenSampler(at::Tensor tokens, int64_t global_batch, int64_t block_size,
                           uint64_t seed)
    : tokens_(std::move(tokens)), global_batch_(global_batch), t_(block_size), sampler_(seed) {
  TORCH_CHECK(tokens_.numel() >= t_ + 2, "TokenSampler: ", tokens_.numel(),
              " tokens hold fewer than block_size + 2 = ", t_ + 2);
}

at::Tensor TokenSampler::Next() {
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < global_batch_; ++i) {
    const int64_t offset = static_cast<int64_t>(sampler_() % (tokens_.numel() - t_ - 1));
    rows.push_back(tokens_.narrow(0, offset, t_ + 1));
  }
  return at::stack(rows);
}

void TokenSampler::Skip(int64_t batches) {
  sampler_.discard(static_cast<unsigned long long>(batches) * global_batch_);
}

BatchSource::BatchSource(const at::Tensor& tokens, int64_t global_batch, int64_t block_size,
                         int steps)
    : t_(block_size), sampler_(tokens, global_batch, block_size, absl::GetFlag(FLAGS_seed) + 1) {
  const std::string path = absl::GetFlag(FLAGS_replay_batches);
  if (path.empty()) return;
  const fsdp::StateDict recorded = fsdp::ValueOrThrow(fsdp::LoadTorchStateDict(path));
  for (const auto& [name, tensor] : recorded) {
    if (name == "tokens") replay_ = tensor;
    if (name == "first_step") replay_first_step_ = tensor.item<int64_t>();
  }
  if (!replay_.defined() || replay_.dim() != 3 || replay_.scalar_type() != at::kLong ||
      replay_.size(1) != global_batch || replay_.size(2) != t_ + 1) {
    throw std::runtime_error(absl::StrFormat(
        "--replay_batches=%s: expected an int64 'tokens' tensor of shape [steps, %d, %d] "
        "(world_size * batch_size, block_size + 1), found %s",
        path, global_batch, t_ + 1,
        replay_.defined() ? absl::StrCat(std::string(c10::toString(replay_.scalar_type())),
                                         " of shape ", c10::str(replay_.sizes()))
                          : std::string("no 'tokens' entry")));
  }
  const int64_t last = replay_first_step_ + replay_.size(0) - 1;
  if (replay_first_step_ != 1 || steps > last) {
    throw std::runtime_error(absl::StrFormat(
        "--replay_batches=%s holds steps %d..%d; --steps=%d must be within them", path,
        replay_first_step_, last, steps));
  }
}

at::Tensor BatchSource::Next(int step) {
  if (replay_.defined()) return replay_[step - replay_first_step_];
  return sampler_.Next();
}

}  // namespace train_gpt
