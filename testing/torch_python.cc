#include "testing/torch_python.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "torch/version.h"

namespace fsdp::testing {

namespace {

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

}  // namespace

std::string TorchPython() {
  if (std::string chosen = Env("FSDP_TORCH_PYTHON"); !chosen.empty()) return chosen;
#if TORCH_VERSION_MAJOR < 2
  // A libtorch 1.x build compares with Debian's torch 1.13, not the venv's
  // 2.x (another pickle default, other kernels in the baselines).
  return "/usr/bin/python3";
#else
  std::string venv = Env("FSDP_TORCH_VENV");
  if (venv.empty() && !Env("HOME").empty()) {
    venv = Env("HOME") + "/.cache/fsdp_cpp/torch-2.15.0-venv";  // As tools/install_deps.sh.
  }
  if (!venv.empty() && access((venv + "/bin/python").c_str(), X_OK) == 0) {
    return venv + "/bin/python";
  }
  return "/usr/bin/python3";
#endif
}

int BuiltTorchMajorVersion() { return TORCH_VERSION_MAJOR; }

std::string ScriptPath(const std::string& relative) {
  if (access(relative.c_str(), R_OK) == 0) return relative;
  char exe[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return relative;
  return std::string(exe, n) + ".runfiles/fsdp_cpp/" + relative;
}

}  // namespace fsdp::testing
