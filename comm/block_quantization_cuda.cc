// Registers the CUDA kernels (block_quantization_cuda_kernels.cu) for
// comm/block_quantization.h's CUDA tensors, at static initialization: a
// program that links this library (alwayslink; CMake: its objects) codes
// on the GPU.
#include <cstdint>
#include <limits>

#include "c10/cuda/CUDAException.h"
#include "c10/cuda/CUDAGuard.h"
#include "c10/cuda/CUDAStream.h"
#include "c10/util/Exception.h"
#include "comm/block_quantization.h"
#include "comm/block_quantization_cuda_kernels.h"

namespace fsdp {
namespace {

cuda_kernels::ValueType TypeOf(const at::Tensor& values) {
  switch (values.scalar_type()) {
    case at::kFloat:
      return cuda_kernels::ValueType::kFloat;
    case at::kDouble:
      return cuda_kernels::ValueType::kDouble;
    case at::kHalf:
      return cuda_kernels::ValueType::kHalf;
    case at::kBFloat16:
      return cuda_kernels::ValueType::kBFloat16;
    default:
      TORCH_CHECK(false, "block quantization: unsupported dtype ", values.scalar_type());
  }
}

// One thread block per quantization block: the grid's x dimension.
void CheckGridFits(const BlockTable& table) {
  TORCH_CHECK(table.blocks() <= std::numeric_limits<int32_t>::max(),
              "block quantization: ", table.blocks(),
              " blocks exceed a CUDA grid; code fewer values per call");
}

void QuantizeOnDevice(const at::Tensor& values, const at::Tensor& bytes, const BlockTable& table) {
  CheckGridFits(table);
  const c10::cuda::CUDAGuard on_device(values.device());
  const int error = cuda_kernels::LaunchQuantizeBlocks(
      TypeOf(values), values.data_ptr(), bytes.data_ptr<uint8_t>(),
      table.rows().data_ptr<int64_t>(), table.runs(), table.blocks(),
      c10::cuda::getCurrentCUDAStream(values.device().index()).stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(error));
}

void DequantizeOnDevice(const at::Tensor& bytes, const BlockTable& table,
                        const at::Tensor& values) {
  CheckGridFits(table);
  const c10::cuda::CUDAGuard on_device(values.device());
  const int error = cuda_kernels::LaunchDequantizeBlocks(
      TypeOf(values), bytes.data_ptr<uint8_t>(), table.rows().data_ptr<int64_t>(), table.runs(),
      table.blocks(), values.data_ptr(),
      c10::cuda::getCurrentCUDAStream(values.device().index()).stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(error));
}

[[maybe_unused]] const bool kRegistered =
    RegisterCudaBlockQuantizationKernels({&QuantizeOnDevice, &DequantizeOnDevice});

}  // namespace
}  // namespace fsdp
