#include "optim/run_checkpoints.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "formats/restricted_unpickler.h"

namespace fsdp {
namespace {

constexpr char kStepPrefix[] = "step-";

std::string Steps(const std::vector<StepCheckpoint>& entries) {
  return absl::StrJoin(entries, ", ", [](std::string* out, const StepCheckpoint& e) {
    absl::StrAppend(out, e.step);
  });
}

std::string RunName(const std::string& run_id) {
  return run_id.empty() ? std::string("a run without an id (saved before run ids)")
                        : absl::StrCat("run ", run_id);
}

// What `entries` hold, for a refusal: "run 1f..: steps 5, 10; interrupted
// saves: step 12".
std::string Describe(const std::vector<StepCheckpoint>& entries) {
  std::map<std::string, std::vector<StepCheckpoint>> by_run;
  std::vector<StepCheckpoint> incomplete, damaged;
  for (const StepCheckpoint& e : entries) {
    switch (e.state) {
      case StepCheckpoint::State::kComplete:
        by_run[e.run_id].push_back(e);
        break;
      case StepCheckpoint::State::kIncomplete:
        incomplete.push_back(e);
        break;
      case StepCheckpoint::State::kDamaged:
        damaged.push_back(e);
        break;
    }
  }
  std::vector<std::string> parts;
  for (const auto& [run, steps] : by_run) {
    parts.push_back(absl::StrCat(RunName(run), ": step(s) ", Steps(steps)));
  }
  if (!incomplete.empty()) {
    parts.push_back(absl::StrCat("interrupted saves (neither manifest.pb nor .metadata): step(s) ",
                                 Steps(incomplete)));
  }
  if (!damaged.empty()) {
    parts.push_back(absl::StrCat("damaged: step(s) ", Steps(damaged)));
  }
  return absl::StrJoin(parts, "; ");
}

// Removes a checkpoint directory (flat: shard files and a manifest).
absl::Status RemoveCheckpointDirectory(const std::string& path) {
  DIR* d = opendir(path.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("cannot list '", path, "': ", std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  // The manifest (or .metadata) first: from then on a crash leaves an
  // interrupted save, never a checkpoint with missing shards.
  std::stable_partition(names.begin(), names.end(), [](const std::string& n) {
    return n == "manifest.pb" || n == ".metadata";
  });
  for (const std::string& name : names) {
    const std::string file = path + "/" + name;
    if (unlink(file.c_str()) != 0 && errno != ENOENT) {
      return absl::UnavailableError(
          absl::StrCat("cannot remove '", file, "': ", std::strerror(errno)));
    }
  }
  if (rmdir(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(
        absl::StrCat("cannot remove '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// A DCP step directory's state, run id, recorded step and settings (its
// train_state's, when it has one).
void ReadDcpTrainState(StepCheckpoint& entry) {
  const auto damaged = [&](const std::string& problem) {
    entry.state = StepCheckpoint::State::kDamaged;
    entry.problem = problem;
    entry.run_id.clear();
    entry.settings.clear();
  };
  absl::StatusOr<DcpMetadata> metadata = ReadDcpMetadata(entry.path);
  if (!metadata.ok()) return damaged(std::string(metadata.status().message()));
  if (absl::Status files = CheckDcpDataFiles(entry.path, *metadata); !files.ok()) {
    return damaged(std::string(files.message()));
  }
  entry.state = StepCheckpoint::State::kComplete;
  const std::string prefix = absl::StrCat(kDcpTrainStateKey, ".");
  const std::string settings = absl::StrCat(prefix, kDcpSettingsKey, ".");
  for (const DcpBytesEntry& bytes : metadata->bytes) {
    const bool setting = absl::StartsWith(bytes.fqn, settings);
    if (bytes.fqn != prefix + kRunIdMetadataKey && bytes.fqn != prefix + kStepMetadataKey &&
        !setting) {
      continue;
    }
    absl::StatusOr<PyRef> value = ReadDcpBytes(entry.path, bytes);
    if (!value.ok()) return damaged(std::string(value.status().message()));
    if (bytes.fqn == prefix + kRunIdMetadataKey || setting) {
      if ((*value)->kind != PyValue::Kind::kString) {
        return damaged(absl::StrCat("'", bytes.fqn, "' is not a string"));
      }
      if (setting) {
        entry.settings[bytes.fqn.substr(settings.size())] = (*value)->s;
      } else {
        entry.run_id = (*value)->s;
      }
    } else if ((*value)->kind != PyValue::Kind::kInt || (*value)->i != entry.step) {
      return damaged(
          absl::StrCat("'", bytes.fqn, "' is not ", entry.step, ", the step its directory names"));
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<StepCheckpoint>> ListStepCheckpoints(const std::string& dir) {
  std::vector<StepCheckpoint> found;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return found;
    return absl::UnavailableError(
        absl::StrCat("cannot list the checkpoint directory '", dir, "': ", std::strerror(errno)));
  }
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    int64_t step = 0;
    if (name.rfind(kStepPrefix, 0) != 0 ||
        !absl::SimpleAtoi(name.substr(sizeof(kStepPrefix) - 1), &step) || step < 0) {
      continue;
    }
    StepCheckpoint entry;
    entry.step = step;
    entry.path = dir + "/" + name;
    struct stat st;
    if (stat(entry.path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (IsDcpDirectory(entry.path)) {
      entry.format = StepCheckpoint::Format::kDcp;
      if (stat((entry.path + "/manifest.pb").c_str(), &st) == 0) {
        entry.state = StepCheckpoint::State::kDamaged;
        entry.problem =
            "it holds both a Distributed Checkpoint's .metadata and a SHARDED manifest.pb";
      } else {
        ReadDcpTrainState(entry);
      }
      found.push_back(std::move(entry));
      continue;
    }
    absl::StatusOr<CheckpointMetadata> metadata = ReadCheckpointMetadata(entry.path);
    if (metadata.ok()) {
      entry.state = StepCheckpoint::State::kComplete;
      for (const auto& [key, value] : *metadata) {
        if (key == kRunIdMetadataKey) entry.run_id = value;
        if (absl::StartsWith(key, kSettingMetadataPrefix)) {
          entry.settings[key.substr(sizeof(kSettingMetadataPrefix) - 1)] = value;
        }
      }
    } else if (absl::IsNotFound(metadata.status())) {
      entry.state = StepCheckpoint::State::kIncomplete;
    } else {
      entry.state = StepCheckpoint::State::kDamaged;
      entry.problem = std::string(metadata.status().message());
    }
    found.push_back(std::move(entry));
  }
  closedir(d);
  std::sort(found.begin(), found.end(),
            [](const StepCheckpoint& a, const StepCheckpoint& b) { return a.step < b.step; });
  return found;
}

std::string NewRunId() {
  std::random_device random;
  const uint64_t id = (static_cast<uint64_t>(random()) << 32) | random();
  return absl::StrFormat("%016x", id);
}

absl::StatusOr<RunCheckpoints> RunCheckpoints::Open(const std::string& dir,
                                                    const RunCheckpointsOptions& options,
                                                    const std::string& new_run_id) {
  if (dir.empty()) return absl::InvalidArgumentError("RunCheckpoints: no directory given");
  if (options.keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunCheckpoints: keep must be >= 1, got ", options.keep));
  }
  if (new_run_id.empty()) return absl::InvalidArgumentError("RunCheckpoints: empty run id");
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir);
  if (!entries.ok()) return entries.status();
  RunCheckpoints run;
  run.dir_ = dir;
  run.keep_ = options.keep;
  run.run_id_ = new_run_id;
  run.settings_ = options.settings;

  if (!options.resume) {
    if (entries->empty()) return run;
    if (!options.overwrite) {
      return absl::FailedPreconditionError(absl::StrCat(
          "'", dir, "' already holds checkpoints of another run (", Describe(*entries),
          "); a new run would mix with them: resume that run (--resume), choose another "
          "directory, or replace them (--overwrite_checkpoints: removed once this run's "
          "first checkpoint is saved)"));
    }
    run.replaced_ = *entries;
    run.notes_.push_back(absl::StrCat("the checkpoints already in '", dir, "' (",
                                      Describe(*entries),
                                      ") will be removed once this run's first checkpoint is "
                                      "saved"));
    return run;
  }

  std::map<std::string, std::vector<StepCheckpoint>> complete_by_run;
  const StepCheckpoint* newest_complete = nullptr;
  for (const StepCheckpoint& e : *entries) {
    if (e.state != StepCheckpoint::State::kComplete) continue;
    complete_by_run[e.run_id].push_back(e);
    newest_complete = &e;
  }
  if (newest_complete == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no complete checkpoint to resume from in '", dir, "'",
        entries->empty() ? std::string(" (it holds no step-NNNNNNNN directory)")
                         : absl::StrCat(" (", Describe(*entries), ")")));
  }
  if (complete_by_run.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", dir, "' holds complete checkpoints of ", complete_by_run.size(),
        " different runs (", Describe(*entries), "); which one to continue is ambiguous: "
        "remove the other run's step directories"));
  }
  const StepCheckpoint& newest = entries->back();
  if (newest.state == StepCheckpoint::State::kDamaged) {
    return absl::DataLossError(absl::StrCat(
        "the newest checkpoint, '", newest.path, "', is damaged: ", newest.problem,
        "; remove it to resume from step ", newest_complete->step));
  }
  for (const StepCheckpoint& e : *entries) {
    // An interrupted save is of no use to anyone: with one job in the
    // directory at a time, nobody is still writing it.
    if (e.state == StepCheckpoint::State::kIncomplete) {
      run.replaced_.push_back(e);
      run.notes_.push_back(absl::StrCat(
          "'", e.path, "' holds neither manifest.pb nor .metadata (an interrupted save)",
          e.step > newest_complete->step
              ? absl::StrCat("; resuming from step ", newest_complete->step, " instead")
              : std::string(),
          "; it is removed once this run saves a checkpoint"));
    } else if (e.state == StepCheckpoint::State::kDamaged && e.step > newest_complete->step) {
      run.notes_.push_back(absl::StrCat("'", e.path, "' is newer but damaged: ", e.problem,
                                        "; resuming from step ", newest_complete->step,
                                        " instead, and leaving it as it is"));
    }
  }
  run.resume_from_ = *newest_complete;
  run.run_id_ = newest_complete->run_id;
  return run;
}

std::string RunCheckpoints::PathOf(int64_t step) const {
  return absl::StrFormat("%s/%s%08d", dir_, kStepPrefix, step);
}

CheckpointMetadata RunCheckpoints::MetadataOf(int64_t step) const {
  CheckpointMetadata metadata = {{kRunIdMetadataKey, run_id_},
                                 {kStepMetadataKey, absl::StrCat(step)}};
  for (const auto& [name, value] : settings_) {
    metadata[absl::StrCat(kSettingMetadataPrefix, name)] = value;
  }
  return metadata;
}

std::map<std::string, std::string> RunCheckpoints::DcpLabels() const {
  std::map<std::string, std::string> labels = {{kRunIdMetadataKey, run_id_}};
  for (const auto& [name, value] : settings_) {
    labels[absl::StrCat(kDcpSettingsKey, ".", name)] = value;
  }
  return labels;
}

std::vector<DcpItem> RunCheckpoints::DcpTrainStateOf(int64_t step) const {
  const auto at = [](const std::vector<std::string>& keys) {
    std::vector<DcpPathPart> path = {{false, kDcpTrainStateKey, 0}};
    for (const std::string& key : keys) path.push_back({false, key, 0});
    return path;
  };
  std::vector<DcpItem> items = {{at({kStepMetadataKey}), c10::IValue(step)},
                                {at({kRunIdMetadataKey}), c10::IValue(run_id_)}};
  for (const auto& [name, value] : settings_) {
    items.push_back({at({kDcpSettingsKey, name}), c10::IValue(value)});
  }
  return items;
}

RunCheckpoints::Retired RunCheckpoints::RetireOlderThan(int64_t step) {
  Retired retired;
  auto remove = [&](const std::string& path) {
    absl::Status removed = RemoveCheckpointDirectory(path);
    if (removed.ok()) {
      retired.removed.push_back(path);
    } else {
      retired.problems.push_back(std::string(removed.message()));
    }
  };
  const std::string saved = PathOf(step);
  for (const StepCheckpoint& old : replaced_) {
    if (old.path != saved) remove(old.path);
  }
  replaced_.clear();
  absl::StatusOr<std::vector<StepCheckpoint>> entries = ListStepCheckpoints(dir_);
  if (!entries.ok()) {
    retired.problems.push_back(std::string(entries.status().message()));
    return retired;
  }
  std::vector<const StepCheckpoint*> older;
  for (const StepCheckpoint& e : *entries) {
    if (e.step < step && e.state == StepCheckpoint::State::kComplete && e.run_id == run_id_) {
      older.push_back(&e);
    }
  }
  // `step` itself is one of the `keep`.
  const size_t keep_older = static_cast<size_t>(keep_ - 1);
  for (size_t k = 0; k + keep_older < older.size(); ++k) remove(older[k]->path);
  return retired;
}

}  // namespace fsdp
