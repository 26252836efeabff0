// Where this process sits in a multi-process job, read from the environment
// that launchers set.
//
// Recognized, in this order of precedence:
//   torchrun / torch.distributed.launch / this project's launcher:
//     RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
//     TORCHELASTIC_USE_AGENT_STORE (the launcher hosts the store)
//   SLURM (srun):
//     SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
//     SLURM_TASKS_PER_NODE, and MASTER_ADDR / MASTER_PORT if set, otherwise the
//     first host of SLURM_JOB_NODELIST (or SLURM_NODELIST) and port 29500.
// Reading is pure: it takes a lookup function, so tests need not touch the
// process environment.
#ifndef FSDP_COMM_LAUNCH_ENVIRONMENT_H_
#define FSDP_COMM_LAUNCH_ENVIRONMENT_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace fsdp {

struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;
  int master_port = 0;
  // True when the launcher, not rank 0, serves the rendezvous store.
  bool store_hosted_by_launcher = false;
  // "torchrun" or "slurm": which variables were read, for messages.
  std::string source;
  // How many times the launcher has restarted the job
  // (TORCHELASTIC_RESTART_COUNT; 0 without it): a restarted rank resumes
  // rather than starts afresh.
  int restart_count = 0;
};

// Returns the value of an environment variable, or nullopt if unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Looks variables up in this process's environment.
std::optional<std::string> ProcessEnv(const std::string& name);

// Fails with kNotFound when no launcher's variables are present, and with
// kInvalidArgument naming the variable when one is missing, malformed, or
// inconsistent with the others (RANK >= WORLD_SIZE, a port out of range, ...).
absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(
    const EnvLookup& lookup = ProcessEnv);

// The first host of a SLURM host list: "node[07-09,12],gpu1" -> "node07".
// Exposed for tests.
absl::StatusOr<std::string> FirstHostOfSlurmNodeList(const std::string& nodelist);

// The task count on the first node of a SLURM tasks-per-node value:
// "4(x2),3" -> 4. Exposed for tests.
absl::StatusOr<int> FirstCountOfSlurmTasksPerNode(const std::string& value);

}  // namespace fsdp

#endif  // FSDP_COMM_LAUNCH_ENVIRONMENT_H_
