#include "models/job_test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"

namespace models {
namespace testing {

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp ? tmp : "/tmp") + "/" + name;
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  return dir;
}

CommandResult RunCommand(const std::string& command) {
  CommandResult run;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) run.output += buffer;
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return run;
}

std::vector<double> LossesOf(const std::string& metrics_path) {
  std::vector<double> losses;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\": ");
    double loss = 0;
    if (at == std::string::npos ||
        !absl::SimpleAtod(line.substr(at + 8, line.find(',', at) - at - 8), &loss)) {
      ADD_FAILURE() << "bad metrics line: " << line;
      continue;
    }
    losses.push_back(loss);
  }
  return losses;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool Exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

}  // namespace testing
}  // namespace models
