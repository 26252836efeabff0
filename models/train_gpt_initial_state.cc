#include "models/train_gpt_initial_state.h"

#include <fnmatch.h>

#include <cstdio>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "formats/dcp.h"
#include "formats/torch_file.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_optimizer.h"
#include "optim/optim_state.h"
#include "optim/torch_optim_file.h"
#include "statedict/dcp_sharded.h"
#include "statedict/state_dict.h"

namespace train_gpt {
namespace {

// The first path parts of a Distributed Checkpoint's entries (as dcp.save
// saw the nested state dict: {"model": ..., "optim": ...} -> model, optim).
std::set<std::string> DcpTopLevelKeys(const fsdp::DcpMetadata& metadata) {
  std::set<std::string> keys;
  const auto add = [&](const std::string& name) {
    auto path = metadata.planner_data.find(name);
    if (path != metadata.planner_data.end() && !path->second.empty() &&
        !path->second.front().is_index) {
      keys.insert(path->second.front().key);
    } else {
      keys.insert(name.substr(0, name.find('.')));
    }
  };
  for (const fsdp::DcpTensorEntry& t : metadata.tensors) add(t.fqn);
  for (const fsdp::DcpBytesEntry& b : metadata.bytes) add(b.fqn);
  return keys;
}

// "'model', 'optim'".
std::string Quoted(const std::set<std::string>& names) {
  return absl::StrJoin(names, ", ", [](std::string* out, const std::string& name) {
    absl::StrAppend(out, "'", fsdp::PrintableText(name), "'");
  });
}

// What to say when --init_state_dict's (or --init_optim_state_dict's)
// entries lie under top-level keys: with no key given, which key
// `key_flag` should name (the first of `wanted` among `top_level`); with
// one given that is not among them, which there are. "" otherwise.
std::string KeyHint(const std::string& given_key, const std::set<std::string>& top_level,
                    const char* key_flag, const std::vector<std::string>& wanted) {
  if (!given_key.empty()) {
    if (top_level.count(given_key) != 0) return "";
    return absl::StrCat(" (no entry lies under --", key_flag, "=",
                        fsdp::PrintableText(given_key), "; its top-level keys are ",
                        Quoted(top_level), ")");
  }
  for (const std::string& key : wanted) {
    if (top_level.count(key) != 0) {
      return absl::StrCat(" (its entries lie under the top-level keys ", Quoted(top_level),
                          ": --", key_flag, "=", key, " takes those under '", key, "')");
    }
  }
  return "";
}

// What --init_state_dict holds: the names of its entries (under `key`),
// a hint when they lie under a top-level key, and a torch.save file's
// tensors, which every rank reads whole (a Distributed Checkpoint's are
// read later, each rank only the chunks of its own shards).
struct InitialStateSource {
  std::vector<std::string> names;
  std::string hint;
  fsdp::StateDict state;
};

InitialStateSource ReadInitialStateSource(const std::string& path, const std::string& key,
                                          bool dcp) {
  InitialStateSource source;
  if (dcp) {
    const fsdp::DcpMetadata metadata = fsdp::ValueOrThrow(fsdp::ReadDcpMetadata(path));
    const std::string prefix = key.empty() ? "" : key + ".";
    for (const fsdp::DcpTensorEntry& t : metadata.tensors) {
      if (absl::StartsWith(t.fqn, prefix)) source.names.push_back(t.fqn.substr(prefix.size()));
    }
    source.hint = KeyHint(key, DcpTopLevelKeys(metadata), "init_state_dict_key", {"model"});
  } else {
    source.state = fsdp::ValueOrThrow(fsdp::LoadTorchStateDict(path, key));
    for (const auto& [name, tensor] : source.state) source.names.push_back(name);
  }
  return source;
}

// " (dropped by --init_state_dict_ignore: a, b)", or "" when none was.
std::string DroppedNote(const std::set<std::string>& dropped) {
  return dropped.empty() ? ""
                         : absl::StrCat(" (dropped by --init_state_dict_ignore: ",
                                        absl::StrJoin(dropped, ", "), ")");
}

// "3 entries are not in the model: a, b, c", the first 8 named.
std::string UnexpectedEntries(const std::set<std::string>& unexpected) {
  std::vector<std::string> shown(unexpected.begin(), unexpected.end());
  const size_t more = shown.size() > 8 ? shown.size() - 8 : 0;
  shown.resize(shown.size() - more);
  return absl::StrCat(unexpected.size(), " entries are not in the model: ",
                      fsdp::PrintableText(absl::StrJoin(shown, ", ")),
                      more > 0 ? absl::StrCat(" and ", more, " more") : "");
}

}  // namespace

void LoadInitialState(fsdp::FullyShardedModel& fsdp_model, const std::set<std::string>& model_keys,
                      bool print) {
  const std::string path = absl::GetFlag(FLAGS_init_state_dict);
  const std::vector<std::string> ignore = absl::GetFlag(FLAGS_init_state_dict_ignore);
  const std::string key = absl::GetFlag(FLAGS_init_state_dict_key);
  const bool dcp = fsdp::IsDcpDirectory(path);
  const auto fail = [&](absl::string_view why, const std::string& hint) {
    throw std::runtime_error(absl::StrCat("--init_state_dict=", path, ": ", why, hint));
  };
  InitialStateSource source = ReadInitialStateSource(path, key, dcp);
  std::set<std::string> dropped, unexpected;
  for (const std::string& name : source.names) {
    if (model_keys.count(name) != 0) continue;
    bool matched = false;
    for (const std::string& glob : ignore) {
      matched = matched || fnmatch(glob.c_str(), name.c_str(), 0) == 0;
    }
    (matched ? dropped : unexpected).insert(name);
  }
  if (!unexpected.empty()) {
    fail(UnexpectedEntries(unexpected),
         source.hint.empty()
             ? " (entries the model does not have can be dropped with "
               "--init_state_dict_ignore=GLOB,...; nanoGPT checkpoints from torch < 2 "
               "carry their causal masks as '*.attn.bias')"
             : source.hint);
  }
  if (dcp) {
    // Every rank reads only the chunks that hold its own shards.
    fsdp::ShardedLoadStats stats;
    if (absl::Status loaded = fsdp::LoadShardedDcpModel(fsdp_model, path, key, &stats);
        !loaded.ok()) {
      fail(loaded.message(), source.hint);
    }
    if (print) {
      std::printf("initialized from %s (rank 0 read %.2f MiB for its %.2f MiB of shards)%s\n",
                  path.c_str(), stats.bytes_read / 1048576.0, stats.bytes_needed / 1048576.0,
                  DroppedNote(dropped).c_str());
    }
    return;
  }
  // Every rank keeps its own shards of what it read.
  fsdp::StateDict kept;
  for (auto& [name, tensor] : source.state) {
    if (dropped.count(name) == 0) kept.emplace_back(name, std::move(tensor));
  }
  if (absl::Status loaded = fsdp::LoadFullStateDict(fsdp_model, kept); !loaded.ok()) {
    fail(loaded.message(), "");
  }
  if (print) {
    std::printf("initialized from %s%s\n", path.c_str(), DroppedNote(dropped).c_str());
  }
}

void LoadInitialOptimizerState(torch::nn::Module& model, fsdp::FullyShardedModel& fsdp_model,
                               torch::optim::Optimizer& optimizer, bool print) {
  const std::string path = absl::GetFlag(FLAGS_init_optim_state_dict);
  // An index-keyed file names the optimizer's parameters by position
  // across its groups.
  std::map<const void*, std::string> fqn_of;
  for (const auto& item : model.named_parameters()) {
    fqn_of.emplace(item.value().unsafeGetTensorImpl(), item.key());  // A tied one's first.
  }
  std::vector<std::string> fqn_of_index;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& param : group.params()) {
      fqn_of_index.push_back(fqn_of.at(param.unsafeGetTensorImpl()));
    }
  }
  const std::string key = absl::GetFlag(FLAGS_init_optim_state_dict_key);
  absl::Status loaded;
  if (fsdp::IsDcpDirectory(path)) {
    // Every rank reads only its own part of the elementwise state.
    absl::StatusOr<std::map<std::string, fsdp::ParamShardPlace>> places =
        fsdp::OptimizerShardPlaces(fsdp_model, optimizer);
    absl::StatusOr<fsdp::OptimStateDict> state =
        places.ok() ? fsdp::LoadDcpOptimStateDictPart(path, key, *places, fqn_of_index)
                    : places.status();
    loaded = state.ok() ? fsdp::LoadShardedOptimStateDict(fsdp_model, optimizer, *state)
                        : state.status();
  } else {
    absl::StatusOr<fsdp::OptimStateDict> state =
        fsdp::LoadTorchOptimStateDict(path, key, fqn_of_index);
    loaded = state.ok() ? fsdp::LoadFullOptimStateDict(fsdp_model, optimizer, *state)
                        : state.status();
  }
  if (!loaded.ok()) {
    const bool groups_differ =
        absl::StrContains(loaded.message(), "parameter groups, the optimizer");
    std::string hint;
    if (fsdp::IsDcpDirectory(path)) {
      if (absl::StatusOr<fsdp::DcpMetadata> metadata = fsdp::ReadDcpMetadata(path);
          metadata.ok()) {
        hint = KeyHint(key, DcpTopLevelKeys(*metadata), "init_optim_state_dict_key",
                       {"optim", "optimizer"});
      }
    }
    throw std::runtime_error(absl::StrCat(
        "--init_optim_state_dict=", path, ": ", loaded.message(),
        groups_differ ? " (nanoGPT's optimizer has two: --weight_decay_groups=nanogpt)" : "",
        hint));
  }
  const std::string hyperparameters = ApplyGivenHyperparameters(optimizer);
  if (print) {
    std::printf("optimizer state from %s; optimizer: %s\n", path.c_str(),
                hyperparameters.c_str());
  }
}

}  // namespace train_gpt
