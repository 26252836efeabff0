"""The external repositories this project's BUILD files name.

WORKSPACE calls fsdp_cpp_repositories(); so does the WORKSPACE of any other
workspace that depends on this one (docs/architecture.md, "Layout and dependency
direction"), after its own local_repository(name = "fsdp_cpp", ...). A
repository the caller already declared is left as the caller has it, so a
larger build can point @libtorch_cc_api at another libtorch.
"""

load(":system_repository.bzl", "system_repository")

def fsdp_cpp_repositories():
    if not native.existing_rule("local_cuda"):
        # Only `--config=cuda` builds use this; see third_party/README.md.
        system_repository(
            name = "local_cuda",
            build_file = Label("//third_party:cuda.BUILD"),
            default_path = "/usr/local/cuda",
            path_env = "FSDP_CUDA_PATH",
        )
    if not native.existing_rule("libtorch_cuda"):
        # `--config=cuda` builds link this CUDA-enabled libtorch instead of
        # Debian's: a pip torch's package directory (include/, lib/), e.g.
        #   export FSDP_LIBTORCH_PATH=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
        system_repository(
            name = "libtorch_cuda",
            build_file = Label("//third_party:libtorch_cuda.BUILD"),
            default_path = "/opt/libtorch",
            missing_targets = ["libtorch"],
            path_env = "FSDP_LIBTORCH_PATH",
        )
    if not native.existing_rule("libtorch_cc_api"):
        # libtorch's C++ frontend headers (torch/nn, torch/optim, ...) sit in
        # a subdirectory of Debian's libtorch-dev that is not on the default
        # include path; //third_party:libtorch exports them.
        native.new_local_repository(
            name = "libtorch_cc_api",
            build_file = str(Label("//third_party:libtorch_cc_api.BUILD")),
            path = "/usr/include/torch/csrc/api/include",
        )
