// Two test hosts on one machine: network namespaces joined by a veth pair, each
// with its own address on a subnet that exists only between them, so that a
// multi-node job's traffic crosses a real (virtual) link that a test can
// count, cut, or limit to a rate, and that no traffic leaves. Needs root and iproute2's
// `ip netns`; Available() says why not otherwise, for a skip.
//
//   auto hosts = NetnsHosts::Create();      // node0 10.211.0.1, node1 .2
//   std::system((hosts->Prefix(1) + "models/train_gpt ...").c_str());
//   int64_t sent = hosts->TxBytes(0).value();
//
// On each host its name (node0, node1) is the host name, and both names
// resolve to their addresses: `ip netns exec` mounts
// /etc/netns/<namespace>/hosts over /etc/hosts, which Create writes. Everything Create made
// (namespaces, their veth ends, the /etc/netns entries) is removed by the destructor, also when a
// test fails; processes still running in a namespace are killed first. Not thread-safe.
#ifndef FSDP_TESTING_NETNS_HOSTS_H_
#define FSDP_TESTING_NETNS_HOSTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp::testing {

class NetnsHosts {
 public:
  // OK when this process can make namespaces (root, `ip netns` works);
  // otherwise why not.
  static absl::Status Available();
  static absl::StatusOr<std::unique_ptr<NetnsHosts>> Create();
  ~NetnsHosts();

  int size() const { return static_cast<int>(names_.size()); }
  const std::string& name(int host) const { return names_[host]; }            // "node0"
  const std::string& address(int host) const { return addresses_[host]; }     // "10.211.0.1"
  const std::string& interface(int host) const { return interfaces_[host]; }  // Its link.
  // What runs a shell command on `host`: in its network namespace, with its
  // name as the host name ("ip netns exec <namespace> unshare --uts ...").
  std::string Prefix(int host) const;
  // Bytes the host's end of the link has sent, from the kernel's counter.
  absl::StatusOr<int64_t> TxBytes(int host) const;
  // That counter's file as processes on the host see it (their own sysfs).
  std::string TxBytesPath(int host) const;
  // Limits what each end of the link sends to `bits_per_second` (a token
  // bucket filter, `tc qdisc ... tbf`, on both ends: a full-duplex link of
  // that rate); 0 takes the limit off. Rate only: this kernel has no netem,
  // so no added delay.
  absl::Status ShapeLink(int64_t bits_per_second);
  // A lost host, as the others see it: its link goes down (its processes
  // run on, cut off), or every process on it is killed (SIGKILL).
  absl::Status TakeLinkDown(int host);
  absl::Status KillProcesses(int host);

 private:
  NetnsHosts() = default;

  std::vector<std::string> namespaces_, names_, addresses_, interfaces_;
  std::string scripts_;  // A temporary directory of per-host wrappers.
  bool made_etc_netns_ = false;
};

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_NETNS_HOSTS_H_
