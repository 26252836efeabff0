"""A repository that is a directory already on this machine, chosen by an
environment variable, so that nothing in WORKSPACE downloads.

Used for toolkits whose location differs between hosts (the CUDA toolkit, a
CUDA-enabled libtorch). Bazel re-evaluates the repository when the variable
changes. A missing directory is an error only when a target that needs the
repository is built, so the default CPU build never looks for it.
"""

def _system_repository_impl(ctx):
    path = ctx.os.environ.get(ctx.attr.path_env, ctx.attr.default_path)
    root = ctx.path(path)
    if not root.exists:
        fail("%s: directory %s does not exist; set %s to where it is installed" %
             (ctx.name, path, ctx.attr.path_env))
    for entry in root.readdir():
        ctx.symlink(entry, entry.basename)
    ctx.symlink(ctx.attr.build_file, "BUILD.bazel")

system_repository = repository_rule(
    implementation = _system_repository_impl,
    attrs = {
        "path_env": attr.string(mandatory = True),
        "default_path": attr.string(mandatory = True),
        "build_file": attr.label(mandatory = True, allow_single_file = True),
    },
    environ = ["FSDP_CUDA_PATH"],
    local = True,
)
