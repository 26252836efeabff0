#include "fsdp/trace.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp {
namespace {

// JSON string contents: FQNs are identifiers and dots, but be safe.
std::string Escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", c);
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

TraceRecorder::TraceRecorder(int rank) : rank_(rank) {}

int64_t TraceRecorder::NowUs() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceRecorder::AddSpan(std::string name, std::string unit, int64_t begin_us,
                            int64_t end_us) {
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find(threads_.begin(), threads_.end(), me);
  if (it == threads_.end()) it = threads_.insert(threads_.end(), me);
  events_.push_back(TraceEvent{std::move(name), std::move(unit), begin_us, end_us - begin_us,
                               static_cast<int>(it - threads_.begin()) + 1});
}

std::vector<TraceEvent> TraceRecorder::Events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

absl::Status TraceRecorder::WriteChromeTrace(const std::string& path) const {
  std::string json = absl::StrCat(
      "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n"
      "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": ",
      rank_, ", \"tid\": 0, \"args\": {\"name\": \"rank ", rank_, "\"}}");
  for (const TraceEvent& e : Events()) {
    absl::StrAppend(&json, ",\n{\"name\": \"", Escaped(e.name), "\", \"cat\": \"fsdp\", ",
                    "\"ph\": \"X\", \"pid\": ", rank_, ", \"tid\": ", e.tid,
                    ", \"ts\": ", e.begin_us, ", \"dur\": ", e.duration_us,
                    ", \"args\": {\"unit\": \"", Escaped(e.unit), "\"}}");
  }
  json += "\n]}\n";
  const std::string temp = path + ".tmp";
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (file == nullptr) return absl::UnavailableError("cannot write the trace " + temp);
  const bool written = std::fwrite(json.data(), 1, json.size(), file) == json.size();
  if (std::fclose(file) != 0 || !written || std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return absl::UnavailableError("cannot write the trace " + path);
  }
  return absl::OkStatus();
}

TraceSpan::TraceSpan(TraceRecorder* recorder, const char* name, const std::string& unit)
    : recorder_(recorder), name_(name), unit_(unit),
      begin_us_(recorder != nullptr ? recorder->NowUs() : 0) {
  if (!at::hasCallbacks()) return;
  auto range = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!range->isActive()) return;
  range->before(absl::StrCat("fsdp::", name, " ", unit), c10::ArrayRef<const c10::IValue>{});
  profiler_range_ = std::move(range);
}

TraceSpan::TraceSpan(TraceSpan&& other) noexcept { *this = std::move(other); }

// A span still open here never ended (its post hook did not run, as when
// forward threw): it is dropped, not recorded with a wrong end.
TraceSpan& TraceSpan::operator=(TraceSpan&& other) noexcept {
  if (this == &other) return *this;
  recorder_ = nullptr;
  End();
  recorder_ = std::exchange(other.recorder_, nullptr);
  name_ = std::exchange(other.name_, nullptr);
  unit_ = std::move(other.unit_);
  begin_us_ = other.begin_us_;
  profiler_range_ = std::move(other.profiler_range_);
  return *this;
}

TraceSpan::~TraceSpan() { End(); }

void TraceSpan::End() {
  profiler_range_.reset();  // Its destructor ends the profiler's range.
  if (recorder_ == nullptr) return;
  recorder_->AddSpan(name_, unit_, begin_us_, recorder_->NowUs());
  recorder_ = nullptr;
}

}  // namespace fsdp
