#include "models/job_start_in_fork.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <variant>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "models/train_gpt_start.h"

namespace models {
namespace testing {

CommandResult StartJobInFork(const std::string& flags) {
  std::vector<std::string> args = {"train_gpt"};
  for (absl::string_view flag : absl::StrSplit(flags, ' ', absl::SkipEmpty())) {
    args.emplace_back(flag);
  }
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  CommandResult start;
  int output[2];
  if (::pipe(output) != 0) return start;
  std::fflush(nullptr);  // Else the fork would write this process's buffered output again.
  const pid_t child = ::fork();
  if (child == 0) {
    ::dup2(output[1], STDOUT_FILENO);
    ::dup2(output[1], STDERR_FILENO);
    ::close(output[0]);
    ::close(output[1]);
    int exit_code = 0;
    try {
      absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
      std::variant<int, train_gpt::JobStart> started = train_gpt::StartJob(std::nullopt);
      if (const int* refused = std::get_if<int>(&started)) exit_code = *refused;
    } catch (const std::exception& e) {
      // As main() would end (std::terminate): never back into the test,
      // whose remaining cases the child would otherwise run.
      std::fprintf(stderr, "terminate called after throwing: %s\n", e.what());
      exit_code = 134;
    } catch (...) {
      exit_code = 134;
    }
    std::fflush(nullptr);
    ::_exit(exit_code);
  }
  ::close(output[1]);
  if (child < 0) {
    ::close(output[0]);
    return start;
  }
  char buffer[4096];
  for (ssize_t got; (got = ::read(output[0], buffer, sizeof(buffer))) > 0;) {
    start.output.append(buffer, static_cast<size_t>(got));
  }
  ::close(output[0]);
  int status = 0;
  if (::waitpid(child, &status, 0) != child) return start;
  start.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return start;
}

}  // namespace testing
}  // namespace models
