// The check every loader runs before it changes anything: what it was
// given (a state dict, an optimizer state dict, a checkpoint's manifest)
// against what the model holds. FULL and LOCAL state dicts, FULL optimizer
// state and SHARDED checkpoints all report through it, so one mistake reads
// the same whichever way it is loaded:
//
//   <context>: 'a.weight' has shape [3, 3], the model's is [11, 13];
//   'a.bias' has dtype Double, the model's is Float; missing: b.weight;
//   not in the model: c.weight
//
// Every problem is collected before the error is returned, so a user fixes
// them in one pass; the caller loads nothing unless the check passes.
#ifndef FSDP_STATEDICT_LOAD_CHECK_H_
#define FSDP_STATEDICT_LOAD_CHECK_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "c10/core/ScalarType.h"
#include "c10/util/ArrayRef.h"

namespace fsdp {

class LoadCheck {
 public:
  // `subject` is how the problem names the tensor, quoted: "'a.weight'", or
  // "'a.weight' state 'exp_avg'" for optimizer state.
  static std::string Quoted(absl::string_view name);

  // Each records a problem when the given value differs from the model's and
  // returns whether they agree.
  bool ShapeMatches(const std::string& subject, c10::IntArrayRef given, c10::IntArrayRef model);
  bool DtypeMatches(const std::string& subject, c10::ScalarType given, c10::ScalarType model) {
    return DtypeMatches(subject, c10::toString(given), c10::toString(model));
  }
  // Dtypes by name (c10::toString's), as a checkpoint's manifest stores them.
  bool DtypeMatches(const std::string& subject, absl::string_view given, absl::string_view model);

  // A name the model has and the input lacks, or the reverse; each kind is
  // listed once, in the order reported.
  void Missing(absl::string_view name) { missing_.emplace_back(name); }
  void NotInModel(absl::string_view name) { not_in_model_.emplace_back(name); }

  // Any other problem, as a full phrase ("'a' appears twice").
  void Problem(std::string problem) { problems_.push_back(std::move(problem)); }

  bool ok() const { return problems_.empty() && missing_.empty() && not_in_model_.empty(); }

  // OK, or InvalidArgument "<context>: <every problem>"; a long list of
  // missing names (or of names not in the model) is cut to its first ones
  // and a count of all by their last part.
  absl::Status ToStatus(absl::string_view context) const;

 private:
  std::vector<std::string> problems_;
  std::vector<std::string> missing_;
  std::vector<std::string> not_in_model_;
};

}  // namespace fsdp

#endif  // FSDP_STATEDICT_LOAD_CHECK_H_
