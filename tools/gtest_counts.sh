# Sourced by tools/test.sh and tools/test_torch2.sh.
# gtest_counts STATUS < list of gtest XML reports: prints "N passed, N
# failed" over the individual test cases. A non-zero STATUS with no failed
# case counts one failure (a crash or a timeout leaves no report of it).
gtest_counts() {
  local status=$1 passed=0 failed=0 xml header tests failures errors disabled
  count() { grep -o " $1=\"[0-9]*\"" <<<"$header" | grep -o '[0-9]*' || echo 0; }
  while IFS= read -r xml; do
    header=$(grep -o '<testsuites [^>]*' "$xml" | head -1)
    tests=$(count tests); failures=$(count failures); errors=$(count errors)
    disabled=$(count disabled)
    failed=$((failed + failures + errors))
    passed=$((passed + tests - disabled - failures - errors))
  done
  if [[ $status -ne 0 && $failed -eq 0 ]]; then failed=1; fi
  echo "$passed passed, $failed failed"
}
