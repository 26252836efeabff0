# Sourced by the CMake scripts (cmake_build.sh, test_torch2.sh,
# test_consumers.sh): sets `launcher` to the CMake arguments that compile
# through ccache, with its cache outside the clone and paths relative to the
# clone, so that fresh clones (CI) hit what earlier ones compiled; empty
# without ccache.
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/fsdp_cpp/ccache}
  export CCACHE_BASEDIR=$PWD
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
