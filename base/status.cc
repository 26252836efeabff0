#include "base/status.h"

#include <string>

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

}  // namespace fsdp
