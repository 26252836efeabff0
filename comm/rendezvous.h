// Rendezvous of a multi-process job through c10d's TCPStore, and creation of
// the job's collectives from the launch environment.
//
// As with torchrun, either rank 0 serves the store at MASTER_ADDR:MASTER_PORT,
// or the launcher does (TORCHELASTIC_USE_AGENT_STORE=True; this project's
// local launcher always does, so that the store outlives any one rank).
// Adapter file: c10d's Store type appears here.
#ifndef FSDP_COMM_RENDEZVOUS_H_
#define FSDP_COMM_RENDEZVOUS_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/collectives.h"
#include "comm/gloo_collectives.h"
#include "comm/hybrid_groups.h"
#include "comm/launch_environment.h"
#include "torch/csrc/distributed/c10d/Store.hpp"

namespace c10d {
class TCPStore;
}  // namespace c10d

namespace fsdp {

// A TCPStore server owned by a launcher. Ranks connect to it as clients;
// the launchers of a multi-node job meet through the one node 0's launcher
// serves.
class RendezvousServer {
 public:
  // Listens on `port` (0: any free port) of all interfaces.
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> Start(int port,
                                                                 std::chrono::milliseconds timeout);

  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  ~RendezvousServer();

  int port() const;
  // The served store, for the launcher's own keys.
  c10::intrusive_ptr<c10d::Store> store() const;

 private:
  explicit RendezvousServer(c10::intrusive_ptr<c10d::TCPStore> store);
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

// Connects to the job's store (serving it first if this is rank 0 and the
// launcher does not). A store the launcher serves outlives the job's
// attempts, so each attempt's ranks meet under their own prefix,
// "/worker/attempt_<restart_count>/", as torch's env:// rendezvous has
// Python ranks do: a restarted rank never reads a failed attempt's keys.
// Fails with kUnavailable, naming the address, when the
// store cannot be reached within `timeout`.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectRendezvousStore(
    const LaunchEnvironment& env, std::chrono::milliseconds timeout);

// Connects to a store that another process serves at host:port (a
// launcher's, from another launcher), retrying until `connect_timeout`.
// `operation_timeout` becomes the store's timeout, which bounds waits for
// keys; libtorch 2.x's client waits for other answers without a limit, so
// callers that must end when the server's host is lost use a DeadlineStore
// (comm/store_deadline.h). Fails with kUnavailable naming the address.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStoreAt(
    const std::string& host, int port, std::chrono::milliseconds connect_timeout,
    std::chrono::milliseconds operation_timeout);

// The world group of the job described by `env`, over Gloo. When `options`
// names no interface or hostname, GLOO_SOCKET_IFNAME is used if set, then
// 127.0.0.1 if the whole job is on this host (MASTER_ADDR is a loopback
// address and LOCAL_WORLD_SIZE == WORLD_SIZE), else the local address of
// the route to MASTER_ADDR (the interface that reaches the store reaches
// the other hosts as a rule; GLOO_SOCKET_IFNAME chooses another).
absl::StatusOr<std::unique_ptr<Collectives>> CreateGlooCollectivesFromEnvironment(
    const LaunchEnvironment& env, GlooOptions options = {});

// Connects further groups of the job described by `env` over Gloo (each
// under a name of its own, as torch.distributed.new_group makes them), all
// through one connection to its store; the address is chosen as
// CreateGlooCollectivesFromEnvironment chooses it. For a background
// checkpoint's groups (checkpoint/async_checkpoint.h), say. It only
// connects to the store: where rank 0 serves it (no launcher does), call it
// after the job's groups were created, whose store that is.
absl::StatusOr<GroupConnector> GlooConnectorFromEnvironment(const LaunchEnvironment& env,
                                                            GlooOptions options = {});

// torch.distributed.init_process_group for this library: the world group,
// over Gloo, of the job whose launcher started this process (torchrun,
// launch/ installed as fsdp_launch, or srun: ReadLaunchEnvironment).
// kNotFound, saying how to launch, when no launcher's variables are set.
absl::StatusOr<std::unique_ptr<Collectives>> InitProcessGroup(GlooOptions options = {});

// The world group and hybrid sharding's shard and replicate groups
// (comm/hybrid_groups.h) of the job described by `env`, through one
// connection to its store. Shard groups have `shard_group_size` ranks, or
// LOCAL_WORLD_SIZE (one node each) when it is 0; fails with
// kInvalidArgument when that does not divide the world size.
struct HybridGroupsFromEnvironment {
  std::unique_ptr<Collectives> world;
  HybridShardCollectives hybrid;
  HybridShardLayout layout;
};
absl::StatusOr<HybridGroupsFromEnvironment> CreateHybridGlooCollectivesFromEnvironment(
    const LaunchEnvironment& env, int shard_group_size, GlooOptions options = {});

}  // namespace fsdp

#endif  // FSDP_COMM_RENDEZVOUS_H_
