// Helpers for tests that run the main job's binary (or any command) and
// read what it wrote.
#ifndef FSDP_MODELS_JOB_TEST_UTIL_H_
#define FSDP_MODELS_JOB_TEST_UTIL_H_

#include <string>
#include <vector>

namespace models {
namespace testing {

// An empty directory `name` under TEST_TMPDIR (or /tmp).
std::string TempDir(const std::string& name);

struct CommandResult {
  int exit_code = -1;  // 128 + the signal when a signal ended it.
  std::string output;  // stdout and stderr, interleaved.
};

// Runs `command` through the shell.
CommandResult RunCommand(const std::string& command);

// The "loss" of every line of a --metrics_jsonl file (a test failure for a
// line without a numeric loss).
std::vector<double> LossesOf(const std::string& metrics_path);

std::string ReadText(const std::string& path);
bool Exists(const std::string& path);

}  // namespace testing
}  // namespace models

#endif  // FSDP_MODELS_JOB_TEST_UTIL_H_
