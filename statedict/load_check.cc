#include "statedict/load_check.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp {
namespace {

// A list of names, whole when short. A long one (a checkpoint of another
// optimizer lacks every parameter's state) is its first names and a count
// of all by their last part ("exp_avg 26, exp_avg_sq 26"), which shows what
// kind of state differs.
std::string NameList(const std::vector<std::string>& names) {
  constexpr size_t kShown = 8;
  if (names.size() <= kShown) return absl::StrJoin(names, ", ");
  std::map<std::string, int> by_last_part;
  for (const std::string& name : names) {
    const size_t cut = name.find_last_of("/.");
    ++by_last_part[cut == std::string::npos ? name : name.substr(cut + 1)];
  }
  return absl::StrCat(
      absl::StrJoin(names.begin(), names.begin() + kShown, ", "), " and ", names.size() - kShown,
      " more (", names.size(), " by their last part: ",
      absl::StrJoin(by_last_part, ", ",
                    [](std::string* out, const std::pair<const std::string, int>& part) {
                      absl::StrAppend(out, part.first, " ", part.second);
                    }),
      ")");
}

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
  if (!missing_.empty()) all.push_back(absl::StrCat("missing: ", NameList(missing_)));
  if (!not_in_model_.empty()) {
    all.push_back(absl::StrCat("not in the model: ", NameList(not_in_model_)));
  }
  return absl::InvalidArgumentError(absl::StrCat(context, ": ", absl::StrJoin(all, "; ")));
}

}  // namespace fsdp
