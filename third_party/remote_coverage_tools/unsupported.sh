#!/bin/sh
echo "bazel coverage is not supported by this offline build (see third_party/README.md)" >&2
exit 1
