"""A repository that is a directory already on this machine, chosen by an
environment variable, so that nothing in WORKSPACE downloads.

Used for toolkits whose location differs between hosts (the CUDA toolkit, a
CUDA-enabled libtorch). Bazel re-evaluates the repository when the variable
changes. A missing directory is an error only when a target that needs the
repository is built, so the default CPU build never looks for it; with
`missing_targets`, even a query that loads the repository works.
"""

def _system_repository_impl(ctx):
    path = ctx.os.environ.get(ctx.attr.path_env, ctx.attr.default_path)
    root = ctx.path(path)
    if not root.exists:
        message = "%s: directory %s does not exist; set %s to where it is installed" % (
            ctx.name,
            path,
            ctx.attr.path_env,
        )
        if not ctx.attr.missing_targets:
            fail(message)

        # Queries over //... still load; building any of these fails, saying why.
        rules = ['genrule(name = "missing", outs = ["missing.h"], cmd = "echo \'%s\' >&2; exit 1")' % message]
        for name in ctx.attr.missing_targets:
            rules.append('cc_library(name = "%s", hdrs = [":missing"], visibility = ["//visibility:public"])' % name)
        ctx.file("BUILD.bazel", "\n".join(rules) + "\n")
        return
    for entry in root.readdir():
        ctx.symlink(entry, entry.basename)
    ctx.symlink(ctx.attr.build_file, "BUILD.bazel")

system_repository = repository_rule(
    implementation = _system_repository_impl,
    attrs = {
        "path_env": attr.string(mandatory = True),
        "default_path": attr.string(mandatory = True),
        "build_file": attr.label(mandatory = True, allow_single_file = True),
        # When the directory is missing: these targets exist but fail to
        # build (naming the variable), instead of the repository failing.
        "missing_targets": attr.string_list(),
    },
    environ = ["FSDP_CUDA_PATH", "FSDP_LIBTORCH_PATH"],
    local = True,
)
