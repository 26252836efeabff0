#include "testing/netns_hosts.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace fsdp::testing {
namespace {

// Runs `command` with sh; its exit status, and its output in `output`.
int Run(const std::string& command, std::string* output = nullptr) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string text;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) text.append(buffer, n);
  const int status = pclose(pipe);
  if (output != nullptr) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

absl::Status RunOrError(const std::string& command) {
  std::string output;
  if (Run(command, &output) != 0) {
    return absl::InternalError(absl::StrCat("`", command, "` failed: ", output));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status NetnsHosts::Available() {
  if (geteuid() != 0) return absl::UnavailableError("network namespaces need root");
  const std::string probe = absl::StrCat("fsdpprobe", getpid());
  std::string output;
  if (Run(absl::StrCat("ip netns add ", probe), &output) != 0) {
    return absl::UnavailableError(absl::StrCat("`ip netns add` fails here: ", output));
  }
  Run(absl::StrCat("ip netns del ", probe));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NetnsHosts>> NetnsHosts::Create() {
  constexpr int hosts = 2;
  std::unique_ptr<NetnsHosts> made(new NetnsHosts());
  const int pid = static_cast<int>(getpid());
  std::string hosts_file = "127.0.0.1 localhost\n";
  for (int h = 0; h < hosts; ++h) {
    made->namespaces_.push_back(absl::StrCat("fsdp", pid, "n", h));
    made->names_.push_back(absl::StrCat("node", h));
    made->addresses_.push_back(absl::StrCat("10.211.0.", h + 1));
    made->interfaces_.push_back(absl::StrCat("fv", pid, "n", h));  // At most 15 characters.
    absl::StrAppend(&hosts_file, made->addresses_[h], " ", made->names_[h], "\n");
  }
  // From here the destructor removes whatever was made.
  char scripts[] = "/tmp/fsdp_netns_XXXXXX";
  if (mkdtemp(scripts) == nullptr) return absl::InternalError("cannot make a temporary directory");
  made->scripts_ = scripts;
  for (int h = 0; h < hosts; ++h) {
    // Each host has its own host name too (a UTS namespace per command),
    // as launchers that resolve their own host name expect.
    const std::string script = absl::StrCat(made->scripts_, "/on_", made->names_[h]);
    std::ofstream(script) << "#!/bin/sh\nhostname " << made->names_[h] << "\nexec \"$@\"\n";
    if (chmod(script.c_str(), 0755) != 0) {
      return absl::InternalError(absl::StrCat("cannot make ", script, " executable"));
    }
  }
  struct stat st;
  made->made_etc_netns_ = stat("/etc/netns", &st) != 0;
  for (int h = 0; h < hosts; ++h) {
    const std::string& ns = made->namespaces_[h];
    const std::string etc = "/etc/netns/" + ns;
    if (Run("mkdir -p " + etc) != 0) {
      return absl::InternalError(absl::StrCat("cannot create ", etc));
    }
    std::ofstream(etc + "/hosts") << hosts_file;
    if (absl::Status s = RunOrError("ip netns add " + ns); !s.ok()) return s;
    if (absl::Status s = RunOrError(absl::StrCat("ip -n ", ns, " link set lo up")); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = RunOrError(absl::StrCat(
          "ip link add ", made->interfaces_[0], " netns ", made->namespaces_[0], " type veth",
          " peer name ", made->interfaces_[1], " netns ", made->namespaces_[1]));
      !s.ok()) {
    return s;
  }
  for (int h = 0; h < hosts; ++h) {
    const std::string prefix = absl::StrCat("ip -n ", made->namespaces_[h], " ");
    if (absl::Status s = RunOrError(absl::StrCat(prefix, "addr add ", made->addresses_[h],
                                                 "/24 dev ", made->interfaces_[h]));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = RunOrError(absl::StrCat(prefix, "link set ", made->interfaces_[h], " up"));
        !s.ok()) {
      return s;
    }
  }
  return made;
}

NetnsHosts::~NetnsHosts() {
  for (const std::string& ns : namespaces_) {
    // Whatever still runs there (a test that failed midway) goes first: a
    // namespace with processes in it outlives `ip netns del`.
    Run(absl::StrCat("ip netns pids ", ns, " | xargs -r kill -9"));
    Run("ip netns del " + ns);
    Run("rm -rf /etc/netns/" + ns);
  }
  if (made_etc_netns_) Run("rmdir /etc/netns");
  if (!scripts_.empty()) Run("rm -rf " + scripts_);
}

std::string NetnsHosts::Prefix(int host) const {
  return absl::StrCat("ip netns exec ", namespaces_[host], " unshare --uts ", scripts_, "/on_",
                      names_[host], " ");
}

std::string NetnsHosts::TxBytesPath(int host) const {
  return absl::StrCat("/sys/class/net/", interfaces_[host], "/statistics/tx_bytes");
}

absl::StatusOr<int64_t> NetnsHosts::TxBytes(int host) const {
  std::string output;
  const std::string command = absl::StrCat(Prefix(host), "cat ", TxBytesPath(host));
  int64_t value = 0;
  if (Run(command, &output) != 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(output), &value)) {
    return absl::InternalError(absl::StrCat("`", command, "`: ", output));
  }
  return value;
}

absl::Status NetnsHosts::ShapeLink(int64_t bits_per_second) {
  if (bits_per_second < 0) return absl::InvalidArgumentError("a link rate cannot be negative");
  for (int h = 0; h < size(); ++h) {
    if (bits_per_second == 0) {
      // No qdisc to delete is not an error here: the link is unshaped.
      Run(absl::StrCat("tc -n ", namespaces_[h], " qdisc del dev ", interfaces_[h], " root"));
      continue;
    }
    // The bucket holds 10 ms of the rate, at least 64 KiB: tbf reaches its
    // rate only with a bucket of rate / HZ or more, and a veth passes
    // packets of up to 64 KiB (GSO), which a smaller bucket would split.
    const int64_t burst = std::max<int64_t>(bits_per_second / 8 / 100, 64 << 10);
    if (absl::Status s = RunOrError(absl::StrCat("tc -n ", namespaces_[h], " qdisc replace dev ",
                                                 interfaces_[h], " root tbf rate ", bits_per_second,
                                                 "bit burst ", burst, " latency 50ms"));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status NetnsHosts::TakeLinkDown(int host) {
  return RunOrError(
      absl::StrCat("ip -n ", namespaces_[host], " link set ", interfaces_[host], " down"));
}

absl::Status NetnsHosts::KillProcesses(int host) {
  return RunOrError(absl::StrCat("ip netns pids ", namespaces_[host], " | xargs -r kill -9"));
}

}  // namespace fsdp::testing
