// Prints the versions of the CUDA runtime and NCCL this build linked against.
// Built only under --config=cuda; it needs no GPU to run.
#include <cstdio>

#include <cuda_runtime_api.h>
#include <nccl.h>

int main() {
  int runtime = 0;
  int nccl = 0;
  cudaRuntimeGetVersion(&runtime);
  ncclGetVersion(&nccl);
  std::printf("cuda runtime %d, nccl %d\n", runtime, nccl);
  return 0;
}
