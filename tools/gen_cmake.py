#!/usr/bin/env python3
"""Writes cmake/targets.cmake from the Bazel BUILD files.

The BUILD files are the one description of the build; the CMake build
(CMakeLists.txt, for hosts with a pip-installed torch and no Bazel) includes
the file this script generates from `bazel query`. CI runs it with --check,
which fails when the committed file differs from what the BUILD files say.

Mapping: every cc_library with sources becomes a shared library (as Bazel's
default dynamic test linking, so that plugins and tests share one registry),
one without sources an INTERFACE library; cc_test an executable and a CTest
test run from the build directory with TEST_TMPDIR set; cc_binary an
executable, or a MODULE library with linkshared; the protoc genrules of
fsdp_cc_proto_library a custom command. Outputs land in <build>/<package>/,
so that the paths tests use ("models/train_gpt") hold from <build>; data
files are copied there too. //third_party:libtorch is the hand-written
fsdp_torch target (CMakeLists.txt); CUDA-only targets are left out.

Tests and testonly targets are built only with BUILD_TESTING (include(CTest)
in CMakeLists.txt). Every other library but those tagged not_installed (a
binary's own code, such as the main job's) is installed and exported as
fsdp_cpp::<target> (find_package(fsdp_cpp CONFIG)), its headers under
include/<package>/ (the root's //:fsdp_cpp as fsdp_cpp::fsdp_cpp, its header
under include/) unless it is tagged internal: a building block the public
libraries link (the file formats behind checkpoint/checkpoint.h), whose
library is installed and whose headers are not, so that a consumer's
compiler cannot reach a function the public headers do not declare;
alwayslink libraries ask their consumers' links for --no-as-needed, which
keeps the static initializers they register with.

Usage: tools/gen_cmake.py [--check]
"""

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "cmake" / "targets.cmake"
QUERY = 'kind("cc_(library|test|binary)|genrule|filegroup", //...)'
# Provided by CMakeLists.txt, or not built by CMake.
EXTERNAL = {
    "//third_party:libtorch": "fsdp_torch",
    "@libtorch_cc_api//:headers": None,
}
# CUDA-only targets (--config=cuda in Bazel; not part of the CMake build yet).
SKIPPED_PREFIXES = (
    "//third_party:cuda",
    "//third_party:c10_cuda",
    "//third_party:nccl",
    "@local_cuda//",
    "//comm:nccl_collectives",  # And //comm:nccl_collectives_benchmark.
    "//comm:block_quantization_cuda",  # And its kernels' genrule.
    "//fsdp:cuda_test",
    "//models:cuda_step_benchmark",
)
# Linker flags that CMakeLists.txt decides: Gloo is a library of its own
# beside Debian's libtorch, but inside a pip torch's libtorch_cpu.
LINKOPT_SUBSTITUTES = {"-lgloo": "${FSDP_GLOO_LIBRARY}"}
TEST_TIMEOUTS = {"small": 60, "medium": 300, "large": 900, "enormous": 3600}


def target_name(label):
    if label in EXTERNAL:
        return EXTERNAL[label]
    package, name = label[2:].split(":")
    if not package:  # The root's //:fsdp_cpp is fsdp_cpp::fsdp_cpp.
        return name.replace(".", "_").replace("-", "_")
    return ("%s_%s" % (package.replace("/", "_"), name)).replace(".", "_").replace("-", "_")


def split(label):
    package, name = label[2:].split(":")
    return package, name


def attributes(rule):
    out = {}
    for child in rule:
        name = child.get("name")
        if child.tag == "list":
            out[name] = [c.get("value") for c in child]
        elif child.tag in ("string", "boolean", "int"):
            out[name] = child.get("value")
    return out


def query():
    xml = subprocess.run(["bazel", "query", "--noshow_progress", "--output=xml", QUERY],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    rules = []
    for rule in ET.fromstring(xml).findall("rule"):
        label = rule.get("name")
        attrs = attributes(rule)
        if label.startswith(SKIPPED_PREFIXES) or label in EXTERNAL:
            continue
        rules.append((rule.get("class"), label, attrs))
    return sorted(rules, key=lambda r: r[1])


def generate(rules):
    # A filegroup in a test's data stands for its files (a test's data may
    # name another package's files only through one); it makes no target.
    filegroups = {label: attrs.get("srcs", []) for kind, label, attrs in rules
                  if kind == "filegroup"}
    rules = [rule for rule in rules if rule[0] != "filegroup"]

    def files_of(label):
        if label not in filegroups:
            return [label]
        return [f for src in filegroups[label] for f in files_of(src)]

    generated = {}  # Output file label -> path under the build directory.
    for kind, label, attrs in rules:
        if kind == "genrule":
            package, _ = split(label)
            for out in attrs.get("outs", []):
                generated[out] = "${CMAKE_BINARY_DIR}/%s/%s" % (package, split(out)[1])

    def source(label):
        if label in generated:
            return generated[label]
        package, name = split(label)
        return "${PROJECT_SOURCE_DIR}/%s/%s" % (package, name) if package else \
            "${PROJECT_SOURCE_DIR}/%s" % name

    def deps_of(attrs):
        names = []
        for dep in attrs.get("deps", []):
            if dep.startswith(SKIPPED_PREFIXES):
                continue
            name = target_name(dep)
            if name is not None:
                names.append(name)
        return names

    rule_labels = {label for _, label, _ in rules}
    lines = [
        "# Generated by tools/gen_cmake.py from the BUILD.bazel files; do not edit.",
        "# Regenerate after changing a BUILD file: tools/gen_cmake.py",
        "",
    ]
    for kind, label, attrs in rules:
        package, name = split(label)
        target = target_name(label)
        out_dir = "${CMAKE_BINARY_DIR}/%s" % package
        testonly = kind == "cc_test" or attrs.get("testonly") == "true"
        lines.append("# %s" % label)
        if testonly:
            lines.append("if(BUILD_TESTING)")
        if kind == "genrule":
            srcs = attrs.get("srcs", [])
            if len(srcs) != 1 or not srcs[0].endswith(".proto"):
                raise SystemExit("gen_cmake: only protoc genrules are supported: " + label)
            outs = [generated[o] for o in attrs["outs"]]
            lines += [
                "add_custom_command(",
                "  OUTPUT %s" % " ".join(outs),
                "  COMMAND ${FSDP_PROTOC} --proto_path=${PROJECT_SOURCE_DIR}"
                " --cpp_out=${CMAKE_BINARY_DIR} %s" % source(srcs[0]),
                "  DEPENDS %s" % source(srcs[0]),
                "  VERBATIM)",
            ]
            lines += ["endif()", ""] if testonly else [""]
            continue
        srcs = [source(s) for s in attrs.get("srcs", []) + attrs.get("hdrs", [])]
        compiled = [s for s in srcs if s.endswith((".cc", ".cpp", ".c"))]
        deps = deps_of(attrs)
        defines = attrs.get("defines", [])
        copts = attrs.get("copts", [])
        linkopts = attrs.get("linkopts", [])
        if kind == "cc_library" and not compiled:
            lines.append("add_library(%s INTERFACE)" % target)
            scope = "INTERFACE"
        elif kind == "cc_library":
            lines.append("add_library(%s SHARED %s)" % (target, " ".join(srcs)))
            lines.append("set_target_properties(%s PROPERTIES LIBRARY_OUTPUT_DIRECTORY %s)"
                         % (target, out_dir))
            scope = "PUBLIC"
        elif kind == "cc_binary" and attrs.get("linkshared") in ("1", "true"):
            stem = name[3:-3] if name.startswith("lib") and name.endswith(".so") else name
            lines.append("add_library(%s MODULE %s)" % (target, " ".join(srcs)))
            lines.append("set_target_properties(%s PROPERTIES OUTPUT_NAME %s PREFIX lib "
                         "SUFFIX .so LIBRARY_OUTPUT_DIRECTORY %s)" % (target, stem, out_dir))
            scope = "PRIVATE"
        else:
            lines.append("add_executable(%s %s)" % (target, " ".join(srcs)))
            lines.append("set_target_properties(%s PROPERTIES OUTPUT_NAME %s "
                         "RUNTIME_OUTPUT_DIRECTORY %s ENABLE_EXPORTS ON)"
                         % (target, name, out_dir))
            scope = "PRIVATE"
        if deps:
            lines.append("target_link_libraries(%s %s %s)" % (target, scope, " ".join(deps)))
        if defines:
            lines.append("target_compile_definitions(%s %s %s)"
                         % (target, scope, " ".join(defines)))
        if copts and scope != "INTERFACE":  # Bazel's copts apply to the rule's own sources.
            lines.append("target_compile_options(%s PRIVATE %s)" % (target, " ".join(copts)))
        # Libraries go with the libraries (after the objects); the rest are
        # linker options.
        linkopts = [LINKOPT_SUBSTITUTES.get(o, o) for o in linkopts]
        libraries = [o for o in linkopts
                     if o.startswith(("-l", "${")) or o == "-pthread"]
        options = [o for o in linkopts if o not in libraries]
        if libraries:
            lines.append("target_link_libraries(%s %s %s)" % (target, scope, " ".join(libraries)))
        if options:
            lines.append("target_link_options(%s %s %s)" % (target, scope, " ".join(options)))
        data_targets, data_files = [], []
        for data in (f for d in attrs.get("data", []) for f in files_of(d)):
            (data_targets if data in rule_labels else data_files).append(data)
        for data in data_files:
            dpackage, dname = split(data)
            destinations = ["${CMAKE_BINARY_DIR}/%s/%s" % (dpackage, dname)]
            if kind == "cc_binary":  # Bazel's runfiles layout, for RunfilePath.
                destinations.append("%s/%s.runfiles/fsdp_cpp/%s/%s"
                                    % (out_dir, name, dpackage, dname))
            for destination in destinations:
                lines.append('configure_file(%s "%s" COPYONLY)' % (source(data), destination))
        if data_targets:
            lines.append("add_dependencies(%s %s)"
                         % (target, " ".join(target_name(d) for d in data_targets)))
        installed = "not_installed" not in attrs.get("tags", [])
        if kind == "cc_library" and not testonly and installed:
            headers = [source(h) for h in attrs.get("hdrs", [])]
            lines.append("target_include_directories(%s %s $<INSTALL_INTERFACE:include>)"
                         % (target, "INTERFACE" if scope == "INTERFACE" else "PUBLIC"))
            if attrs.get("alwayslink") == "true":
                lines.append("target_link_options(%s INTERFACE LINKER:--no-as-needed)" % target)
            lines.append("install(TARGETS %s EXPORT fsdp_cpp_targets)" % target)
            if headers and "internal" not in attrs.get("tags", []):
                lines.append("install(FILES %s DESTINATION include/%s)"
                             % (" ".join(headers), package))
        if kind == "cc_test":
            timeout = TEST_TIMEOUTS[attrs.get("size", "medium")]
            lines += [
                "add_test(NAME %s COMMAND %s WORKING_DIRECTORY ${CMAKE_BINARY_DIR})"
                % (label, " ".join([target] + ['"%s"' % a for a in attrs.get("args", [])])),
                'set_tests_properties(%s PROPERTIES TIMEOUT %d ENVIRONMENT '
                '"TEST_TMPDIR=${CMAKE_BINARY_DIR}/test_tmp/%s")' % (label, timeout, target),
                'file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/test_tmp/%s")' % target,
            ]
            # CTest runs tests in parallel (tools/test_torch2.sh) as Bazel
            # does; those Bazel runs alone, CTest too.
            if "exclusive" in attrs.get("tags", []):
                lines.append("set_tests_properties(%s PROPERTIES RUN_SERIAL TRUE)" % label)
        if testonly:
            lines.append("endif()")
        lines.append("")
    return "\n".join(lines)


def main():
    text = generate(query())
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print("gen_cmake: %s is stale; run tools/gen_cmake.py" % OUT.relative_to(ROOT),
                  file=sys.stderr)
            return 1
        print("gen_cmake: %s matches the BUILD files" % OUT.relative_to(ROOT))
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print("gen_cmake: wrote %s" % OUT.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
