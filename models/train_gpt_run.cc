#include "models/train_gpt_run.h"

#include <chrono>
#include <memory>
#include <optional>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "comm/collectives.h"
#include "comm/hierarchical_collectives.h"
#include "comm/hybrid_groups.h"
#include "comm/rendezvous.h"
#include "comm/staged_collectives.h"
#include "models/train_gpt_config.h"
#include "models/train_gpt_flags.h"
#include "models/train_gpt_report.h"
#include "models/train_gpt_training_run.h"
#ifdef FSDP_WITH_NCCL
#include "comm/nccl_collectives.h"
#endif

namespace train_gpt {
namespace {

// The groups one rank trains on: the world (data split, loss) and, under
// hybrid sharding, the shard and replicate groups FSDP runs on. Under
// staged collectives, `host` holds the Gloo groups that carry them, and
// under two-level ones the world, host and cross-host groups that `world`
// runs on; declared first, they are destroyed last.
struct RankGroups {
  std::vector<std::unique_ptr<fsdp::Collectives>> host;
  std::unique_ptr<fsdp::Collectives> world;
  fsdp::HybridShardCollectives hybrid;
  std::string layout_note;
};

#ifdef FSDP_WITH_NCCL
void ConnectNccl(const fsdp::LaunchEnvironment& env, const Placement& placement,
                 fsdp::HybridShardLayout* layout, RankGroups& groups) {
  fsdp::NcclOptions nccl;
  nccl.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  nccl.blocking_wait = true;  // A dead peer fails the job instead of hanging the device.
  c10::intrusive_ptr<c10d::Store> store =
      fsdp::ValueOrThrow(fsdp::ConnectRendezvousStore(env, nccl.timeout));
  nccl.group_name = "world";
  groups.world = fsdp::ValueOrThrow(fsdp::CreateNcclCollectives(
      store, env.rank, env.world_size, placement.device.index(), nccl));
  if (layout != nullptr) {
    groups.hybrid = fsdp::ValueOrThrow(fsdp::CreateHybridShardCollectives(
        env.rank, *layout, "world",
        fsdp::NcclGroupConnector(store, placement.device.index(), nccl)));
  }
}
#endif

RankGroups ConnectGroups(const fsdp::LaunchEnvironment& env, const Placement& placement,
                         bool hybrid) {
  RankGroups groups;
  auto note = [&](const fsdp::HybridShardLayout& layout) {
    groups.layout_note = absl::StrFormat(" (%d shard groups of %d ranks)",
                                         layout.num_shard_groups(), layout.shard_group_size());
  };
#ifdef FSDP_WITH_NCCL
  if (placement.collectives == "nccl") {
    std::optional<fsdp::HybridShardLayout> layout;
    if (hybrid) {
      const int size = absl::GetFlag(FLAGS_shard_group_size);
      layout = fsdp::ValueOrThrow(fsdp::HybridShardLayout::Create(
          env.world_size, size > 0 ? size : env.local_world_size));
      note(*layout);
    }
    ConnectNccl(env, placement, layout ? &*layout : nullptr, groups);
    return groups;
  }
#endif
  fsdp::GlooOptions gloo;
  gloo.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
  // Under the launcher's 10 s grace after a rank fails: the others must
  // finish explaining the failure before they are killed.
  gloo.fingerprints.report_timeout = std::chrono::seconds(5);
  gloo.check_collective_headers = absl::GetFlag(FLAGS_check_collective_headers);
  if (placement.two_level) {
    // The host groups are hybrid sharding's shard groups of one host each.
    fsdp::HybridGroupsFromEnvironment made =
        fsdp::ValueOrThrow(fsdp::CreateHybridGlooCollectivesFromEnvironment(env, 0, gloo));
    groups.host.push_back(std::move(made.world));
    groups.host.push_back(std::move(made.hybrid.shard));
    groups.host.push_back(std::move(made.hybrid.replicate));
    groups.world =
        fsdp::CreateHierarchicalCollectives(*groups.host[0], *groups.host[1], *groups.host[2]);
    groups.layout_note =
        absl::StrFormat(" (two-level collectives: %d hosts of %d ranks)",
                        made.layout.num_shard_groups(), made.layout.shard_group_size());
  } else if (hybrid) {
    fsdp::HybridGroupsFromEnvironment made = fsdp::ValueOrThrow(
        fsdp::CreateHybridGlooCollectivesFromEnvironment(
            env, absl::GetFlag(FLAGS_shard_group_size), gloo));
    groups.world = std::move(made.world);
    groups.hybrid = std::move(made.hybrid);
    note(made.layout);
  } else {
    groups.world = fsdp::ValueOrThrow(fsdp::CreateGlooCollectivesFromEnvironment(env, gloo));
  }
  if (placement.collectives == "staged") {
    for (std::unique_ptr<fsdp::Collectives>* group :
         {&groups.world, &groups.hybrid.shard, &groups.hybrid.replicate}) {
      if (*group == nullptr) continue;
      groups.host.push_back(std::move(*group));
      *group = fsdp::CreateStagedCollectives(*groups.host.back(), placement.device);
    }
  }
  return groups;
}

}  // namespace

int RunRank(const fsdp::LaunchEnvironment& env, fsdp::FsdpOptions options,
            const fsdp::WrapPolicy& policy, const std::vector<std::string>& notes) {
  const Placement placement =
      fsdp::ValueOrThrow(ResolvePlacement(env.local_rank, env.local_world_size));
  RankGroups groups = ConnectGroups(env, placement, fsdp::IsHybrid(options.strategy));
  // --async_checkpoint's writer commits on Gloo groups of its own: what it
  // carries is in host memory, whatever the training groups' transport.
  fsdp::GroupConnector checkpoint_groups;
  if (absl::GetFlag(FLAGS_async_checkpoint) && !absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    fsdp::GlooOptions gloo;
    gloo.timeout = std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s));
    checkpoint_groups = fsdp::ValueOrThrow(fsdp::GlooConnectorFromEnvironment(env, gloo));
  }
  if (!placement.device.is_cpu()) options.device_id = placement.device;
  BeginModelBuild();  // TrainingRun::Run ends it before the first step.
  try {
    return TrainingRun(options, policy, *groups.world, groups.hybrid, placement.device,
                       checkpoint_groups)
        .Run(groups.layout_note, notes);
  } catch (...) {
    // The other ranks' collective errors then quote this one's reason.
    const std::string why(fsdp::StatusFromCurrentException().message());
    std::vector<fsdp::Collectives*> all = {groups.world.get(), groups.hybrid.shard.get(),
                                           groups.hybrid.replicate.get()};
    for (const auto& host : groups.host) all.push_back(host.get());
    for (fsdp::Collectives* group : all) {
      if (group != nullptr) group->ReportStopped(why.substr(0, why.find('\n')));
    }
    throw;
  }
}

}  // namespace train_gpt
