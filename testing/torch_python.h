// The Python interpreter that interop tests run PyTorch with.
//
// Tests that check our files against PyTorch's own reading and writing
// (torch.save / torch.load, the GPT and its optimizer, FSDP2) run Python
// scripts through this interpreter, a torch of the same major version as
// the libtorch the test was built against:
//   1. $FSDP_TORCH_PYTHON, when set (tools/test.sh and tools/test_torch2.sh
//      set it: Debian's torch 1.13 and PyPI's torch 2.15 respectively);
//   2. else, built against libtorch 2.x, the venv tools/install_deps.sh
//      creates ($FSDP_TORCH_VENV, by default
//      ~/.cache/fsdp_cpp/torch-2.15.0-venv), when it exists;
//   3. else Debian's /usr/bin/python3, whose python3-torch is 1.13.
// tools/torch_python runs the 2.x choice from a shell.
#ifndef FSDP_TESTING_TORCH_PYTHON_H_
#define FSDP_TESTING_TORCH_PYTHON_H_

#include <string>

namespace fsdp::testing {

// The interpreter's path, chosen as above.
std::string TorchPython();

// The major version of the libtorch this binary was built against, for a
// test that needs its Python's torch to be the same (a store client of
// libtorch 1.x hangs on torch 2.x's server).
int BuiltTorchMajorVersion();

// Where a Python script of the source tree (`relative`, "models/x.py"),
// listed in the binary's `data`, is: the path itself when readable from
// the working directory (bazel test and run, CTest), else in the runfiles
// beside the executable (a binary started from elsewhere).
std::string ScriptPath(const std::string& relative);

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_TORCH_PYTHON_H_
