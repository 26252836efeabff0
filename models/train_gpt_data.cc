#include "models/train_gpt_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
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

// --data_tokens' file mapped read-only, as an int16 / int32 tensor that
// unmaps it when the last view goes.
absl::StatusOr<at::Tensor> MapTokenFile(const std::string& path, at::ScalarType dtype) {
  const std::string flag = absl::StrCat("--data_tokens=", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat(flag, ": cannot open it: ", std::strerror(error)));
  }
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error = errno;
    ::close(fd);
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat(flag, ": cannot stat it: ", std::strerror(error)));
  }
  const int64_t size = info.st_size;
  const int64_t width = static_cast<int64_t>(c10::elementSize(dtype));
  // The pre-launch checks said the same; the file may have changed since.
  // (It must not change while the run maps it: a file cut short under the
  // mapping faults the rank that reads the lost pages.)
  if (size == 0 || size % width != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": ", size, " bytes are not a whole number of ", width, "-byte token ids"));
  }
  void* data = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // The mapping keeps the file.
  if (data == MAP_FAILED) {
    return absl::InternalError(absl::StrCat(flag, ": cannot map it: ", std::strerror(errno)));
  }
  // from_blob's tensor is writable by type; nothing writes a corpus, and
  // PROT_READ turns a mistake into a fault rather than a silent change.
  return at::from_blob(
      data, {size / width}, [size](void* p) { ::munmap(p, static_cast<size_t>(size)); },
      at::TensorOptions().dtype(dtype));
}

}  // namespace

at::ScalarType TokenFileDtype() {
  const std::string dtype = absl::GetFlag(FLAGS_data_tokens_dtype);
  // PreLaunchProblems refused any other name, a recorded one included.
  TORCH_CHECK(dtype == "uint16" || dtype == "uint32", "--data_tokens_dtype=", dtype,
              ": must be uint16 or uint32");
  return dtype == "uint32" ? at::kInt : at::kShort;
}

absl::StatusOr<Corpus> LoadCorpus() {
  Corpus corpus;
  if (const std::string path = absl::GetFlag(FLAGS_data_tokens); !path.empty()) {
    FSDP_ASSIGN_OR_RETURN(const at::Tensor tokens, MapTokenFile(path, TokenFileDtype()));
    const int64_t held_out = HeldOutBytes(tokens.numel());
    corpus.train = tokens.narrow(0, 0, tokens.numel() - held_out);
    corpus.held_out = tokens.narrow(0, tokens.numel() - held_out, held_out);
    corpus.source = absl::StrCat("--data_tokens=", path);
    corpus.unit = "tokens";
    return corpus;
  }
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
  corpus.source = absl::StrCat("--data=", path);
  return corpus;
}

TokenSampler::TokenSampler(at::Tensor tokens, int64_t global_batch, int64_t block_size,
                           uint64_t seed, int64_t vocab_size, std::string source)
    : tokens_(std::move(tokens)),
      global_batch_(global_batch),
      t_(block_size),
      vocab_size_(vocab_size),
      source_(std::move(source)),
      sampler_(seed) {
  TORCH_CHECK(tokens_.numel() >= t_ + 2, "TokenSampler: ", tokens_.numel(),
              " tokens hold fewer than block_size + 2 = ", t_ + 2);
}

at::Tensor TokenSampler::Next() {
  std::vector<at::Tensor> rows;
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < global_batch_; ++i) {
    offsets.push_back(static_cast<int64_t>(sampler_() % (tokens_.numel() - t_ - 1)));
    rows.push_back(tokens_.narrow(0, offsets.back(), t_ + 1));
  }
  at::Tensor batch = at::stack(rows).to(at::kLong);
  // The file's unsigned ids, read as signed: widened, then the sign bits
  // the widening copied cleared.
  if (tokens_.scalar_type() == at::kShort) batch.bitwise_and_(0xFFFF);
  if (tokens_.scalar_type() == at::kInt) batch.bitwise_and_(int64_t{0xFFFFFFFF});
  const at::Tensor bad = batch.ge(vocab_size_).logical_or_(batch.lt(0)).nonzero();
  if (bad.size(0) != 0) {
    const int64_t row = bad[0][0].item<int64_t>(), col = bad[0][1].item<int64_t>();
    throw std::runtime_error(absl::StrFormat(
        "%s: token id %d (the file's token %d, counting from 0) is not below the model's "
        "vocabulary size %d",
        source_.empty() ? std::string("the corpus") : source_, batch[row][col].item<int64_t>(),
        tokens_.storage_offset() + offsets[row] + col, vocab_size_));
  }
  return batch;
}

void TokenSampler::Skip(int64_t batches) {
  sampler_.discard(static_cast<unsigned long long>(batches) * global_batch_);
}

BatchSource::BatchSource(const Corpus& corpus, int64_t global_batch, int64_t block_size,
                         int64_t vocab_size, int steps)
    : t_(block_size),
      sampler_(corpus.train, global_batch, block_size, absl::GetFlag(FLAGS_seed) + 1, vocab_size,
               corpus.source) {
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
  // Every rank checks the whole file, so that an id past the model's
  // embedding stops every rank here rather than one inside its forward.
  const at::Tensor bad = replay_.ge(vocab_size).logical_or_(replay_.lt(0)).nonzero();
  if (bad.size(0) > 0) {
    const int64_t step = bad[0][0].item<int64_t>(), row = bad[0][1].item<int64_t>(),
                  col = bad[0][2].item<int64_t>();
    throw std::runtime_error(absl::StrFormat(
        "--replay_batches=%s: step %d's sequence %d holds id %d at position %d, outside the "
        "model's vocabulary size %d",
        path, replay_first_step_ + step, row, replay_[step][row][col].item<int64_t>(), col,
        vocab_size));
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
