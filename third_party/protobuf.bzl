"""C++ code generation for .proto files with Debian's protoc.

Bazel 4.2.3's native cc_proto_library wants a @com_google_protobuf source
repository, which cannot be fetched here; protoc and libprotobuf from Debian
do the same job through a genrule.
"""

def fsdp_cc_proto_library(name, src, deps = [], visibility = None, testonly = False, tags = []):
    """Generates <src>.pb.{h,cc} with /usr/bin/protoc and wraps them in a cc_library.

    Args:
      name: name of the resulting cc_library.
      src: one .proto file in this package.
      deps: other fsdp_cc_proto_library targets whose .proto files src imports.
      visibility: visibility of the cc_library.
      testonly: as for any rule.
      tags: the cc_library's (tools/gen_cmake.py reads "internal" and
        "not_installed").
    """
    base = src[:-len(".proto")]

    # Paths are the repository's own, whether it is the main workspace or an
    # external one (@fsdp_cpp in a consumer's build, whose sources lie under
    # external/fsdp_cpp): the generated code then includes
    # "statedict/x.pb.h", which the repository's include path finds.
    repo = native.repository_name()
    root = "." if repo == "@" else "external/" + repo[1:]
    native.genrule(
        name = name + "_codegen",
        srcs = [src],
        outs = [base + ".pb.h", base + ".pb.cc"],
        cmd = "protoc --proto_path=%s --cpp_out=$(GENDIR)/%s $(location %s)" % (root, root, src),
        testonly = testonly,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc"],
        hdrs = [base + ".pb.h"],
        deps = deps + ["//third_party:protobuf"],
        testonly = testonly,
        visibility = visibility,
        tags = tags,
    )
