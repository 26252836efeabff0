#include "comm/launch_environment.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(LaunchEnvironment, ReadsTorchrunVariables) {
  auto env = ReadLaunchEnvironment(FakeEnv({{"RANK", "5"},
                                            {"WORLD_SIZE", "8"},
                                            {"LOCAL_RANK", "1"},
                                            {"LOCAL_WORLD_SIZE", "4"},
                                            {"MASTER_ADDR", "10.1.2.3"},
                                            {"MASTER_PORT", "29400"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->source, "torchrun");
  EXPECT_EQ(env->rank, 5);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->local_world_size, 4);
  EXPECT_EQ(env->master_addr, "10.1.2.3");
  EXPECT_EQ(env->master_port, 29400);
  EXPECT_TRUE(env->store_hosted_by_launcher);
}

TEST(LaunchEnvironment, TorchrunWithoutLocalVariablesIsOneNode) {
  auto env = ReadLaunchEnvironment(FakeEnv(
      {{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->local_world_size, 3);
  EXPECT_FALSE(env->store_hosted_by_launcher);
}

TEST(LaunchEnvironment, NamesTheBadTorchrunVariable) {
  const std::map<std::string, std::string> good = {{"RANK", "1"},
                                                   {"WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "h"},
                                                   {"MASTER_PORT", "29500"}};
  struct Case {
    std::string name, value, expected;
  };
  for (const Case& c : std::vector<Case>{
           {"RANK", "2", "RANK=2 is not in [0, WORLD_SIZE=2)"},
           {"RANK", "-1", "RANK=-1 is not in [0, WORLD_SIZE=2)"},
           {"RANK", "one", "RANK='one' is not an integer"},
           {"WORLD_SIZE", "0", "WORLD_SIZE=0 must be >= 1"},
           {"MASTER_PORT", "70000", "MASTER_PORT=70000 is not a TCP port"},
           {"MASTER_ADDR", "", "MASTER_ADDR is empty"},
           {"LOCAL_WORLD_SIZE", "3", "LOCAL_WORLD_SIZE=3 is not in [1, WORLD_SIZE=2]"},
           {"LOCAL_RANK", "4", "LOCAL_RANK=4 is not in [0, LOCAL_WORLD_SIZE=2)"}}) {
    auto vars = good;
    vars[c.name] = c.value;
    auto env = ReadLaunchEnvironment(FakeEnv(vars));
    EXPECT_EQ(env.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(env.status().message(), HasSubstr(c.expected)) << c.name;
  }
  for (const std::string missing : {"WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    auto vars = good;
    vars.erase(missing);
    EXPECT_THAT(ReadLaunchEnvironment(FakeEnv(vars)).status().message(),
                HasSubstr(missing + " is not set"));
  }
}

TEST(LaunchEnvironment, ReadsSlurmVariables) {
  auto env = ReadLaunchEnvironment(FakeEnv({{"SLURM_PROCID", "6"},
                                            {"SLURM_NTASKS", "8"},
                                            {"SLURM_LOCALID", "2"},
                                            {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                            {"SLURM_JOB_NODELIST", "gpu[07-08]"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->source, "slurm");
  EXPECT_EQ(env->rank, 6);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 2);
  EXPECT_EQ(env->local_world_size, 4);
  EXPECT_EQ(env->master_addr, "gpu07");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(LaunchEnvironment, SlurmPrefersExplicitMasterAndTasksPerNode) {
  auto env = ReadLaunchEnvironment(FakeEnv({{"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "4"},
                                            {"SLURM_LOCALID", "0"},
                                            {"SLURM_NTASKS_PER_NODE", "2"},
                                            {"SLURM_TASKS_PER_NODE", "9"},
                                            {"MASTER_ADDR", "head"},
                                            {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->local_world_size, 2);
  EXPECT_EQ(env->master_addr, "head");
  EXPECT_EQ(env->master_port, 1234);
}

TEST(LaunchEnvironment, SlurmErrorsNameTheVariable) {
  auto env = ReadLaunchEnvironment(
      FakeEnv({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
               {"SLURM_TASKS_PER_NODE", "2"}}));
  EXPECT_THAT(env.status().message(), HasSubstr("MASTER_ADDR is not set and there is no "
                                                "SLURM_JOB_NODELIST"));
  env = ReadLaunchEnvironment(FakeEnv({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "0"},
                                       {"SLURM_JOB_NODELIST", "n1"}}));
  EXPECT_THAT(env.status().message(), HasSubstr("neither SLURM_NTASKS_PER_NODE nor "
                                                "SLURM_TASKS_PER_NODE is set"));
  env = ReadLaunchEnvironment(FakeEnv({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                                       {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2"},
                                       {"SLURM_JOB_NODELIST", "n[1-"}}));
  EXPECT_THAT(env.status().message(), HasSubstr("SLURM_JOB_NODELIST: unbalanced brackets"));
}

TEST(LaunchEnvironment, NothingSetIsNotFound) {
  EXPECT_EQ(ReadLaunchEnvironment(FakeEnv({})).status().code(), absl::StatusCode::kNotFound);
}

TEST(SlurmParsing, FirstHostOfNodeList) {
  EXPECT_EQ(FirstHostOfSlurmNodeList("node1").value(), "node1");
  EXPECT_EQ(FirstHostOfSlurmNodeList("node1,node2").value(), "node1");
  EXPECT_EQ(FirstHostOfSlurmNodeList("node[07-09,12],gpu1").value(), "node07");
  EXPECT_EQ(FirstHostOfSlurmNodeList("rack[3,5]-ib").value(), "rack3-ib");
  EXPECT_FALSE(FirstHostOfSlurmNodeList("").ok());
  EXPECT_FALSE(FirstHostOfSlurmNodeList("node[a-b]").ok());
  EXPECT_FALSE(FirstHostOfSlurmNodeList("node[1").ok());
}

TEST(SlurmParsing, FirstCountOfTasksPerNode) {
  EXPECT_EQ(FirstCountOfSlurmTasksPerNode("4(x2),3").value(), 4);
  EXPECT_EQ(FirstCountOfSlurmTasksPerNode("8").value(), 8);
  EXPECT_FALSE(FirstCountOfSlurmTasksPerNode("x").ok());
  EXPECT_FALSE(FirstCountOfSlurmTasksPerNode("0").ok());
}

}  // namespace
}  // namespace fsdp
