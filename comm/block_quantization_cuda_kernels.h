// The CUDA kernels behind comm/block_quantization.h, behind a plain C++
// interface so that nvcc compiles them without libtorch's headers;
// comm/block_quantization_cuda.cc registers them for CUDA tensors.
// Each launches one thread block per quantization block
// (kQuantizationBlock = 256 threads) on `stream` (a cudaStream_t) over a
// device table of `runs` rows (BlockTable::rows(): value, code and param
// offsets, length, first block) holding `blocks` blocks, and returns the
// launch's cudaError_t (0: launched). The arithmetic is the host's, rounded the
// same way (no fused multiply-add), so both code a block into the same bytes
// and decode them into the same values; only the sign of a zero lo may
// differ (fminf may pick either of -0 and +0), which decodes alike.
#ifndef FSDP_COMM_BLOCK_QUANTIZATION_CUDA_KERNELS_H_
#define FSDP_COMM_BLOCK_QUANTIZATION_CUDA_KERNELS_H_

#include <cstdint>

namespace fsdp::cuda_kernels {

enum class ValueType { kFloat, kDouble, kHalf, kBFloat16 };

int LaunchQuantizeBlocks(ValueType type, const void* values, uint8_t* bytes, const int64_t* table,
                         int64_t runs, int64_t blocks, void* stream);

int LaunchDequantizeBlocks(ValueType type, const uint8_t* bytes, const int64_t* table, int64_t runs,
                           int64_t blocks, void* values, void* stream);

}  // namespace fsdp::cuda_kernels

#endif  // FSDP_COMM_BLOCK_QUANTIZATION_CUDA_KERNELS_H_
