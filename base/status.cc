#include "base/status.h"

#include <string>

#include "absl/strings/str_format.h"
#include "c10/util/Exception.h"

namespace fsdp {

void ThrowIfError(const absl::Status& status) {
  TORCH_CHECK(status.ok(), status.ToString());
}

absl::Status StatusFromCurrentException(absl::StatusCode code) {
  try {
    throw;
  } catch (const c10::Error& e) {
    // what() appends a C++ backtrace; the message alone is what users read.
    return absl::Status(code, e.msg());
  } catch (const std::exception& e) {
    return absl::Status(code, e.what());
  } catch (...) {
    return absl::Status(code, "unknown exception (not derived from std::exception)");
  }
}

std::string PrintableText(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  for (size_t i = 0; i < text.size();) {
    const unsigned char lead = byte(i);
    // The length of the UTF-8 sequence `lead` starts (0: not a lead byte),
    // and the smallest second byte that keeps it shortest-form.
    size_t length = 0;
    unsigned char second_min = 0x80, second_max = 0xbf;
    if (lead >= 0xc2 && lead <= 0xdf) {
      length = 2;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      length = 3;
      if (lead == 0xe0) second_min = 0xa0;
      if (lead == 0xed) second_max = 0x9f;  // Not a UTF-16 surrogate.
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      length = 4;
      if (lead == 0xf0) second_min = 0x90;
      if (lead == 0xf4) second_max = 0x8f;
    }
    bool valid = length > 0 && i + length <= text.size() && byte(i + 1) >= second_min &&
                 byte(i + 1) <= second_max;
    for (size_t k = 2; valid && k < length; ++k) {
      valid = byte(i + k) >= 0x80 && byte(i + k) <= 0xbf;
    }
    if (valid) {
      out.append(text.data() + i, length);
      i += length;
    } else if ((lead >= 0x20 && lead < 0x7f) || lead == '\n' || lead == '\t') {
      out.push_back(static_cast<char>(lead));
      ++i;
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", lead);
      ++i;
    }
  }
  return out;
}

}  // namespace fsdp
