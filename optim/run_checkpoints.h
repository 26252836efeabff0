// The checkpoints of one training run in one directory: which checkpoint a
// run resumes from, which directory a new run may use, and which old
// checkpoints clean-up may remove — so that a run never deletes, mixes or
// resumes another run's checkpoints.
//
// Layout: <dir>/step-NNNNNNNN is the training checkpoint saved after step
// N, in either of two formats:
//   - SHARDED (optim/training_checkpoint.h): its manifest carries the run's
//     id and the step (RunCheckpoints::MetadataOf), written atomically with
//     it;
//   - a PyTorch Distributed Checkpoint of {"model", "optim"}
//     (optim/dcp_checkpoint.h), whose "train_state" entry holds the same
//     as {"step": N, "run_id": id}. One written by a PyTorch job may have
//     no train_state: its step is its directory's, its run id empty.
// So a checkpoint that exists says which run wrote it. A run also records
// its settings (name -> value strings, the caller's to choose) in every
// checkpoint: "setting.<name>" labels of the manifest, "settings" of the
// DCP train_state; a resumed run reads them back (StepCheckpoint::settings).
// A step directory without a manifest or .metadata is an interrupted save;
// one whose manifest or .metadata cannot be read, whose data files are
// missing or short, whose recorded step is not its directory's, or that
// holds both, is damaged. Checkpoints saved without run ids count as one
// run with the empty id.
//
// The rules:
//   * A new run (not resuming) refuses a directory that holds any step
//     directory, unless told to overwrite; then the old ones are removed
//     once the new run's first checkpoint has landed, never before, so the
//     directory always holds a complete checkpoint if it held one.
//   * Resuming continues the run of the newest complete checkpoint, under
//     that run's id. It refuses a directory holding complete checkpoints of
//     more than one run (naming them) and a newest step directory that is
//     damaged; newer interrupted or damaged ones are skipped and named.
//     Interrupted saves are removed once the resumed run's first checkpoint
//     has landed; damaged ones are left for the user to look at.
//   * Clean-up after a checkpoint of step N landed removes only this run's
//     complete checkpoints older than N beyond the newest `keep`.
//
// Only the directory's layout is touched here: saving and loading the
// checkpoints is the caller's (SaveTrainingCheckpoint with MetadataOf(step),
// or checkpoint/checkpoint.h's SaveCheckpoint with DcpLabels() in its
// TrainState; LoadCheckpoint reads either). The rules assume one job writes to the directory
// at a time (base/directory_lock.h keeps it so). Not thread-safe; rank 0 of
// a job alone calls RetireOlderThan, while every rank may Open the same
// directory (read-only).
#ifndef FSDP_OPTIM_RUN_CHECKPOINTS_H_
#define FSDP_OPTIM_RUN_CHECKPOINTS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "formats/dcp.h"
#include "statedict/sharded_checkpoint.h"

namespace fsdp {

// One step-NNNNNNNN entry of a checkpoint directory.
struct StepCheckpoint {
  enum class State {
    kComplete,    // Its manifest is intact.
    kIncomplete,  // No manifest: a save that did not finish.
    kDamaged,     // A manifest that cannot be read (`problem` says why).
  };
  enum class Format {
    kSharded,  // Our own (manifest.pb).
    kDcp,      // A Distributed Checkpoint (.metadata).
  };
  int64_t step = 0;
  std::string path;
  State state = State::kIncomplete;
  Format format = Format::kSharded;  // kComplete and kDamaged only.
  std::string run_id;   // kComplete only; "" when saved without one.
  std::string problem;  // kDamaged only.
  // kComplete only: the settings its run recorded; none in checkpoints
  // saved before runs recorded them, or by PyTorch.
  std::map<std::string, std::string> settings;
};

// Every step-<number> subdirectory of `dir`, by step; none when `dir` does
// not exist. Fails (naming `dir` and the errno) when it cannot be listed.
absl::StatusOr<std::vector<StepCheckpoint>> ListStepCheckpoints(const std::string& dir);

struct RunCheckpointsOptions {
  bool resume = false;     // Continue the directory's run.
  bool overwrite = false;  // A new run may replace another run's checkpoints.
  int keep = 2;            // Complete checkpoints of this run kept by clean-up.
  // What this run records in each of its checkpoints (MetadataOf,
  // DcpTrainStateOf): names of [A-Za-z0-9_] and any values.
  std::map<std::string, std::string> settings;
};

// A fresh run id: 16 random hex digits.
std::string NewRunId();

class RunCheckpoints {
 public:
  // Decides how a run starts in `dir`, reading it only. `new_run_id` is the
  // run's id unless it resumes (then the resumed checkpoint's id is kept);
  // every rank of a job must pass the same one. kFailedPrecondition for a
  // refusal, naming what the directory holds and what to do about it;
  // kDataLoss for a damaged newest checkpoint; kInvalidArgument for bad
  // options.
  static absl::StatusOr<RunCheckpoints> Open(const std::string& dir,
                                             const RunCheckpointsOptions& options,
                                             const std::string& new_run_id);

  const std::string& dir() const { return dir_; }
  const std::string& run_id() const { return run_id_; }
  // The checkpoint to load, when resuming.
  const std::optional<StepCheckpoint>& resume_from() const { return resume_from_; }
  // What the caller should tell the user: skipped interrupted saves, the
  // checkpoints an overwrite or a resumed run will remove.
  const std::vector<std::string>& notes() const { return notes_; }

  // Where step `step`'s checkpoint goes, and what it must carry: the
  // manifest's metadata of a SHARDED one, the values of a DCP one's
  // train_state entry (to save beside its model and optimizer state).
  std::string PathOf(int64_t step) const;
  CheckpointMetadata MetadataOf(int64_t step) const;
  std::vector<DcpItem> DcpTrainStateOf(int64_t step) const;
  // The same train_state entries but the step, as labels (a
  // checkpoint/checkpoint.h TrainState's): "run_id", "settings.<name>".
  std::map<std::string, std::string> DcpLabels() const;

  // Once this run's checkpoint of `step` has landed (rank 0 only): removes
  // this run's complete checkpoints older than `step` beyond the newest
  // `keep`, and, the first time, the checkpoints an overwrite replaces and
  // the interrupted saves a resumed run found.
  // Returns the removed paths; a removal that fails is reported in
  // `problems` (nothing else is affected).
  struct Retired {
    std::vector<std::string> removed;
    std::vector<std::string> problems;
  };
  Retired RetireOlderThan(int64_t step);

 private:
  RunCheckpoints() = default;

  std::string dir_;
  std::string run_id_;
  int keep_ = 2;
  std::optional<StepCheckpoint> resume_from_;
  std::vector<std::string> notes_;
  std::map<std::string, std::string> settings_;
  std::vector<StepCheckpoint> replaced_;  // Removed after the first save.
};

// Metadata keys of a run's checkpoints: of the manifest, and of a DCP
// checkpoint's train_state entry.
inline constexpr char kRunIdMetadataKey[] = "run_id";
inline constexpr char kStepMetadataKey[] = "step";
inline constexpr char kDcpTrainStateKey[] = "train_state";
// A recorded setting's manifest label is kSettingMetadataPrefix + its name;
// in a DCP checkpoint it is train_state.settings.<name>.
inline constexpr char kSettingMetadataPrefix[] = "setting.";
inline constexpr char kDcpSettingsKey[] = "settings";

}  // namespace fsdp

#endif  // FSDP_OPTIM_RUN_CHECKPOINTS_H_
