#!/usr/bin/env bash
# Runs the whole test suite: the layering check, then every Bazel test.
# Arguments are passed to `bazel test`.
# Ends with "N passed, N failed" over the individual gtest cases (and
# ", N skipped" when some were skipped).
set -uo pipefail
cd "$(dirname "$0")/.."

# In-repo targets must use real labels; the root aliases are for other
# workspaces only, and using them would bypass the visibility rules.
query_log=$(mktemp)
started=$(mktemp)  # Reports older than this belong to earlier runs.
trap 'rm -f "$query_log" "$started"' EXIT
if ! aliases_used=$(bazel query --noshow_progress 'rdeps(//..., //:all, 1) - //:all' \
                     2>"$query_log"); then
  echo "layering: bazel query failed:" >&2
  cat "$query_log" >&2
  exit 1
fi
if [[ -n "$aliases_used" ]]; then
  echo "layering: these targets depend on the public aliases in //:BUILD.bazel" \
       "instead of real labels:" >&2
  echo "$aliases_used" >&2
  exit 1
fi

# Includes Bazel's visibility cannot see (GCC has no layering check: a
# header of a dependency's dependency is reachable): the core's flat
# parameter stays inside fsdp/ (other packages read a unit's shard through
# fsdp/shard_placement.h), and the file formats include neither the core
# nor comm/.
layering_includes=$(
  git ls-files '*.h' '*.cc' '*.cu' | grep -v '^fsdp/' |
    xargs grep -nE '#include *[<"]fsdp/(flat_param_handle|gradient_reduction)\.h'
  git ls-files 'formats/*.h' 'formats/*.cc' | xargs grep -nE '#include *[<"](fsdp|comm)/'
)
if [[ -n "$layering_includes" ]]; then
  echo "layering: these includes cross a package boundary the architecture forbids" \
       "(fsdp/BUILD.bazel, formats/BUILD.bazel):" >&2
  echo "$layering_includes" >&2
  exit 1
fi

# Builds come from the cache; tests always run: multi-rank tests exercise
# sockets, processes and timeouts, and a cached pass would hide a flaky one.
# The interop tests' Python is Debian's, whose torch matches this libtorch
# (1.13); tools/test_torch2.sh runs them with PyPI's 2.15.
bazel test --nocache_test_results --test_env=FSDP_TORCH_PYTHON=/usr/bin/python3 //... "$@"
status=$?

source tools/gtest_counts.sh
gtest_counts "$status" < <(find -L bazel-testlogs/ -name test.xml -newer "$started" 2>/dev/null)
exit $status
