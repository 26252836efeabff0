// Error handling shared by every package of the project.
//
// The project reports errors two ways (see README.md, "Errors"):
//   * absl::Status / absl::StatusOr<T> from configuration, planning, launch,
//     registry and I/O code, where the caller can recover;
//   * c10::Error (thrown by TORCH_CHECK) from tensor code, forward passes and
//     autograd hooks, where libtorch can only report failure by throwing.
// This header holds the macros that propagate a Status (Debian's abseil
// 20220623 has none) and the bridge between the two conventions.
#ifndef FSDP_BASE_STATUS_H_
#define FSDP_BASE_STATUS_H_

#include <exception>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define FSDP_RETURN_IF_ERROR(expr)                          \
  do {                                                      \
    ::absl::Status fsdp_status_internal_ = (expr);          \
    if (!fsdp_status_internal_.ok()) return fsdp_status_internal_; \
  } while (false)

#define FSDP_STATUS_CONCAT_INNER_(a, b) a##b
#define FSDP_STATUS_CONCAT_(a, b) FSDP_STATUS_CONCAT_INNER_(a, b)

// `lhs` = the value of `rexpr` (an absl::StatusOr<T>), or returns its status.
// `lhs` may declare a variable: FSDP_ASSIGN_OR_RETURN(auto x, MakeX());
#define FSDP_ASSIGN_OR_RETURN(lhs, rexpr)                                     \
  FSDP_ASSIGN_OR_RETURN_IMPL_(FSDP_STATUS_CONCAT_(fsdp_statusor_, __LINE__), \
                              lhs, rexpr)
#define FSDP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace fsdp {

// Throws c10::Error carrying the status's code and message if it is not OK.
void ThrowIfError(const absl::Status& status);

// Returns the value of `result` or throws as ThrowIfError does.
template <typename T>
T ValueOrThrow(absl::StatusOr<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// Converts the exception being handled into a Status with `code`, keeping
// its message (without the C++ backtrace c10::Error appends). Call only
// inside a `catch` block.
absl::Status StatusFromCurrentException(absl::StatusCode code = absl::StatusCode::kInternal);

// `step()`'s status, or what it threw as one (StatusFromCurrentException):
// a rank that must still reach the collectives after a local step (a write,
// a commit) runs the step so, so that its failure is reported, not a hang.
template <typename Step>
absl::Status CatchAsStatus(Step&& step) {
  try {
    return step();
  } catch (...) {
    return StatusFromCurrentException();
  }
}

// `text` as a message may quote it: bytes that are not printable text
// (control characters but newline and tab, DEL, bytes outside valid UTF-8)
// become \xNN, so that a name read from a damaged file neither cuts a
// message short (an embedded NUL) nor garbles the terminal. Valid UTF-8
// (a path in any language) stays as it is.
std::string PrintableText(absl::string_view text);

}  // namespace fsdp

#endif  // FSDP_BASE_STATUS_H_
