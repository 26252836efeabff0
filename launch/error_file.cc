#include "launch/error_file.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp {
namespace {

using json = nlohmann::json;

// An error file is a few lines; a bigger one is not ours to read whole.
constexpr std::streamoff kMaxErrorFileBytes = 1 << 20;

std::optional<int64_t> IntegerIn(const json& info, const char* key) {
  if (!info.is_object() || !info.contains(key)) return std::nullopt;
  const json& value = info[key];
  if (value.is_number_integer()) return value.get<int64_t>();
  int64_t parsed = 0;
  if (value.is_string() && absl::SimpleAtoi(value.get<std::string>(), &parsed)) return parsed;
  return std::nullopt;
}

}  // namespace

bool WriteRankErrorFile(const std::string& message, std::optional<int64_t> step) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0') return false;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  json info = {{"timestamp", std::to_string(now_ns / 1'000'000'000)},
               {"timestamp_ns", std::to_string(now_ns)}};
  if (step.has_value()) info["step"] = std::to_string(*step);
  const json document = {{"message", {{"message", message}, {"extraInfo", info}}}};
  const std::string temporary = absl::StrCat(path, ".tmp-", ::getpid());
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    // Replacement characters for bytes that are not UTF-8: a message may
    // quote a file's bytes.
    out << document.dump(-1, ' ', false, json::error_handler_t::replace);
    if (!out.flush()) {
      std::remove(temporary.c_str());
      return false;
    }
  }
  if (std::rename(temporary.c_str(), path) != 0) {
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

absl::StatusOr<RankError> ReadRankErrorFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": the rank wrote no error file"));
  std::string text(kMaxErrorFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > static_cast<size_t>(kMaxErrorFileBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": over ", kMaxErrorFileBytes,
                                                   " bytes: not an error file"));
  }
  const json document = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (document.is_discarded() || !document.is_object() || !document.contains("message")) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not an error file (a JSON object with a message)"));
  }
  RankError error;
  const json& message = document["message"];
  if (message.is_string()) {
    error.message = message.get<std::string>();
    return error;
  }
  if (!message.is_object() || !message.contains("message") || !message["message"].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": its message is neither a string nor {\"message\": string}"));
  }
  error.message = message["message"].get<std::string>();
  const json info = message.contains("extraInfo") ? message["extraInfo"] : json();
  error.step = IntegerIn(info, "step");
  if (std::optional<int64_t> ns = IntegerIn(info, "timestamp_ns")) {
    error.timestamp_ns = *ns;
  } else if (std::optional<int64_t> s = IntegerIn(info, "timestamp")) {
    // Whole seconds (torchelastic's @record): the end of that second, so
    // that a rank of ours, timed to the ns, that failed first is not
    // taken for failing after it.
    error.timestamp_ns = *s * 1'000'000'000 + 999'999'999;
  }
  return error;
}

}  // namespace fsdp
