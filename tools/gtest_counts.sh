# Sourced by tools/test.sh and tools/test_torch2.sh.
# gtest_counts STATUS < list of gtest XML reports: prints "N passed, N
# failed" over the individual test cases, and ", N skipped" when some were
# (GTEST_SKIP: a case whose prerequisite this build lacks, which says why in
# its log). A non-zero STATUS with no failed case counts one failure (a
# crash or a timeout leaves no report of it).
gtest_counts() {
  local status=$1 passed=0 failed=0 skipped=0 xml header tests failures errors disabled
  local skips
  count() { grep -o " $1=\"[0-9]*\"" <<<"$header" | grep -o '[0-9]*' || echo 0; }
  while IFS= read -r xml; do
    header=$(grep -o '<testsuites [^>]*' "$xml" | head -1)
    tests=$(count tests); failures=$(count failures); errors=$(count errors)
    disabled=$(count disabled)
    skips=$(grep -c '<skipped' "$xml" || true)
    failed=$((failed + failures + errors))
    skipped=$((skipped + skips))
    passed=$((passed + tests - disabled - failures - errors - skips))
  done
  if [[ $status -ne 0 && $failed -eq 0 ]]; then failed=1; fi
  if [[ $skipped -gt 0 ]]; then
    echo "$passed passed, $failed failed, $skipped skipped"
  else
    echo "$passed passed, $failed failed"
  fi
}
