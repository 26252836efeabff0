#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "torch/csrc/distributed/c10d/PrefixStore.hpp"
#include "torch/csrc/distributed/c10d/TCPStore.hpp"

namespace fsdp {
namespace {

bool IsLoopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || absl::StartsWith(addr, "127.");
}

// The local address the kernel would send from to reach `host` (resolved
// as the store's client resolves it): that of the interface the route to
// the store leaves by. Connecting a UDP socket sends nothing.
std::optional<std::string> LocalAddressToward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return std::nullopt;
  std::optional<std::string> local;
  for (addrinfo* a = found; a != nullptr && !local.has_value(); a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage self{};
    socklen_t length = sizeof(self);
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&self), &length) == 0 &&
        getnameinfo(reinterpret_cast<sockaddr*>(&self), length, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) == 0) {
      local = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return local;
}

// Whether a TCP connection to host:port succeeds within a second; why not
// in `error` otherwise.
bool AcceptsConnections(const std::string& host, int port, std::string* error) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (resolved != 0 || found == nullptr) {
    *error = absl::StrCat("cannot resolve '", host, "': ", gai_strerror(resolved));
    return false;
  }
  bool connected = false;
  for (addrinfo* a = found; a != nullptr && !connected; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int code = connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (code == EINPROGRESS) {
      pollfd waiting{fd, POLLOUT, 0};
      socklen_t length = sizeof(code);
      code = poll(&waiting, 1, /*timeout_ms=*/1000) != 1                 ? ETIMEDOUT
             : getsockopt(fd, SOL_SOCKET, SO_ERROR, &code, &length) != 0 ? errno
                                                                         : code;
    }
    connected = code == 0;
    if (!connected) *error = std::strerror(code);
    close(fd);
  }
  freeaddrinfo(found);
  return connected;
}

}  // namespace

RendezvousServer::RendezvousServer(c10::intrusive_ptr<c10d::TCPStore> store)
    : store_(std::move(store)) {}

RendezvousServer::~RendezvousServer() = default;

int RendezvousServer::port() const { return store_->getPort(); }

c10::intrusive_ptr<c10d::Store> RendezvousServer::store() const { return store_; }

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(
    int port, std::chrono::milliseconds timeout) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("RendezvousServer: port ", port, " is not a TCP port"));
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", options);
    return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(store)));
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(), absl::StrCat("RendezvousServer: cannot listen on port ", port,
                                                   ": ", cause.message()));
  }
}

namespace {

// `may_serve`: rank 0 serves the store when the launcher does not; a second
// connection of rank 0's (for further groups) must only reach it.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const LaunchEnvironment& env,
                                                             std::chrono::milliseconds timeout,
                                                             bool may_serve) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = may_serve && env.rank == 0 && !env.store_hosted_by_launcher;
  options.numWorkers = env.world_size;
  options.waitWorkers = false;
  options.timeout = timeout;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    if (!env.store_hosted_by_launcher) return c10::intrusive_ptr<c10d::Store>(std::move(store));
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::PrefixStore>(
        absl::StrCat("/worker/attempt_", env.restart_count), std::move(store)));
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(
        cause.code(),
        absl::StrCat("rank ", env.rank, " of ", env.world_size, ": cannot ",
                     options.isServer ? "serve" : "reach", " the rendezvous store at ",
                     env.master_addr, ":", env.master_port, " (from ", env.source,
                     " variables) within ", timeout.count(), " ms: ", cause.message()));
  }
}

}  // namespace

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectRendezvousStore(
    const LaunchEnvironment& env, std::chrono::milliseconds timeout) {
  return ConnectStore(env, timeout, /*may_serve=*/true);
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStoreAt(
    const std::string& host, int port, std::chrono::milliseconds connect_timeout,
    std::chrono::milliseconds operation_timeout) {
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("store port ", port, " is not a TCP port"));
  }
  // Until the server listens, c10d's client logs an error per failed
  // attempt: wait for it with plain connections, then connect once.
  const auto deadline = std::chrono::steady_clock::now() + connect_timeout;
  std::string last_error;
  while (!AcceptsConnections(host, port, &last_error)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("cannot reach the store at ", host, ":", port,
                                                 " within ", connect_timeout.count(),
                                                 " ms: ", last_error));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  // Bounds waits for keys (and, in libtorch 1.13, every answer).
  options.timeout = operation_timeout;
  try {
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::TCPStore>(host, options));
  } catch (...) {
    absl::Status cause = StatusFromCurrentException(absl::StatusCode::kUnavailable);
    return absl::Status(cause.code(), absl::StrCat("cannot reach the store at ", host, ":", port,
                                                   ": ", cause.message()));
  }
}

namespace {

GlooOptions WithDefaultAddress(const LaunchEnvironment& env, GlooOptions options) {
  if (options.interface.empty() && options.hostname.empty()) {
    if (std::optional<std::string> ifname = ProcessEnv("GLOO_SOCKET_IFNAME")) {
      options.interface = *ifname;
    } else if (IsLoopback(env.master_addr) && env.local_world_size == env.world_size) {
      options.hostname = "127.0.0.1";
    } else if (std::optional<std::string> local = LocalAddressToward(env.master_addr)) {
      // Across hosts: the address peers reach this host by is, as a rule,
      // the one on the route to the store (Gloo's own default, the
      // address of the host's name, may be a loopback one).
      options.hostname = *local;
    }
  }
  return options;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collectives>> CreateGlooCollectivesFromEnvironment(
    const LaunchEnvironment& env, GlooOptions options) {
  options = WithDefaultAddress(env, options);
  FSDP_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store,
                        ConnectRendezvousStore(env, options.timeout));
  return CreateGlooCollectives(std::move(store), env.rank, env.world_size, options);
}

absl::StatusOr<GroupConnector> GlooConnectorFromEnvironment(const LaunchEnvironment& env,
                                                            GlooOptions options) {
  options = WithDefaultAddress(env, options);
  FSDP_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store,
                        ConnectStore(env, options.timeout, /*may_serve=*/false));
  return GlooGroupConnector(std::move(store), options);
}

absl::StatusOr<std::unique_ptr<Collectives>> InitProcessGroup(GlooOptions options) {
  absl::StatusOr<LaunchEnvironment> env = ReadLaunchEnvironment();
  if (absl::IsNotFound(env.status())) {
    return absl::NotFoundError(absl::StrCat(
        env.status().message(), "; start the program with a launcher: fsdp_launch "
        "--nproc_per_node=N PROGRAM, torchrun --no-python --nproc_per_node=N PROGRAM, or srun"));
  }
  FSDP_RETURN_IF_ERROR(env.status());
  return CreateGlooCollectivesFromEnvironment(*env, std::move(options));
}

absl::StatusOr<HybridGroupsFromEnvironment> CreateHybridGlooCollectivesFromEnvironment(
    const LaunchEnvironment& env, int shard_group_size, GlooOptions options) {
  options = WithDefaultAddress(env, options);
  const int size = shard_group_size > 0 ? shard_group_size : env.local_world_size;
  absl::StatusOr<HybridShardLayout> layout = HybridShardLayout::Create(env.world_size, size);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", env.rank, " of ", env.world_size, ": hybrid sharding with shard groups of ", size,
        shard_group_size > 0 ? "" : " (LOCAL_WORLD_SIZE)", ": ", layout.status().message()));
  }
  FSDP_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store,
                        ConnectRendezvousStore(env, options.timeout));
  HybridGroupsFromEnvironment groups{nullptr, {}, *layout};
  FSDP_ASSIGN_OR_RETURN(groups.world,
                        CreateGlooCollectives(store, env.rank, env.world_size, options));
  FSDP_ASSIGN_OR_RETURN(groups.hybrid,
                        CreateHybridShardCollectives(env.rank, *layout, options.group_name,
                                                     GlooGroupConnector(store, options)));
  return groups;
}

}  // namespace fsdp
