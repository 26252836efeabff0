#include "statedict/load_check.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp {
namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

std::string LoadCheck::Quoted(absl::string_view name) { return absl::StrCat("'", name, "'"); }

bool LoadCheck::ShapeMatches(const std::string& subject, c10::IntArrayRef given,
                             c10::IntArrayRef model) {
  if (given == model) return true;
  problems_.push_back(absl::StrCat(subject, " has shape ", ShapeString(given), ", the model's is ",
                                   ShapeString(model)));
  return false;
}

bool LoadCheck::DtypeMatches(const std::string& subject, absl::string_view given,
                             absl::string_view model) {
  if (given == model) return true;
  problems_.push_back(absl::StrCat(subject, " has dtype ", given, ", the model's is ", model));
  return false;
}

absl::Status LoadCheck::ToStatus(absl::string_view context) const {
  if (ok()) return absl::OkStatus();
  std::vector<std::string> all = problems_;
  if (!missing_.empty()) all.push_back(absl::StrCat("missing: ", absl::StrJoin(missing_, ", ")));
  if (!not_in_model_.empty()) {
    all.push_back(absl::StrCat("not in the model: ", absl::StrJoin(not_in_model_, ", ")));
  }
  return absl::InvalidArgumentError(absl::StrCat(context, ": ", absl::StrJoin(all, "; ")));
}

}  // namespace fsdp
