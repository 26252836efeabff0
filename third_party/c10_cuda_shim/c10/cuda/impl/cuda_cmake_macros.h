// Stand-in for the header a CUDA build of libtorch generates (Debian's
// libtorch-dev ships c10/cuda without it). Same content as libtorch's.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
