#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "comm/block_quantization_cuda_kernels.h"

namespace fsdp::cuda_kernels {
namespace {

constexpr int kThreads = 256;  // kQuantizationBlock: one thread per value.
constexpr int kWarps = kThreads / 32;
constexpr int kColumns = 5;  // value, code, param, length, first block.

// This thread block's block: its run's row and its index in the run.
struct Block {
  const int64_t* run;
  int64_t index;
};

__device__ Block FindBlock(const int64_t* table, int64_t runs) {
  const int64_t b = blockIdx.x;
  int64_t lo = 0, hi = runs - 1;  // The last run whose first block is <= b.
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid * kColumns + 4] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {table + lo * kColumns, b - table[lo * kColumns + 4]};
}

__device__ float ToFloat(float v) { return v; }
__device__ float ToFloat(double v) { return static_cast<float>(v); }
__device__ float ToFloat(__half v) { return __half2float(v); }
__device__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ T FromFloat(float v);
template <>
__device__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ double FromFloat<double>(float v) {
  return static_cast<double>(v);
}
template <>
__device__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The block's smallest and largest value and the sum of value * 0 (NaN
// once a value is not finite), on every thread.
__device__ void BlockRange(float& lo, float& hi, float& probe) {
  __shared__ float s_lo[kWarps], s_hi[kWarps], s_probe[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    probe = __fadd_rn(probe, __shfl_xor_sync(0xffffffffu, probe, offset));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
    s_probe[warp] = probe;
  }
  __syncthreads();
  lo = s_lo[0];
  hi = s_hi[0];
  probe = s_probe[0];
  for (int w = 1; w < kWarps; ++w) {
    lo = fminf(lo, s_lo[w]);
    hi = fmaxf(hi, s_hi[w]);
    probe = __fadd_rn(probe, s_probe[w]);
  }
}

template <typename T>
__global__ void QuantizeKernel(const T* values, uint8_t* bytes, const int64_t* table,
                               int64_t runs) {
  const Block block = FindBlock(table, runs);
  const int64_t at = block.index * kThreads;
  const int64_t value = block.run[0] + at, code = block.run[1] + at;
  const int64_t param = block.run[2] + block.index * 8;
  const int64_t length = min(static_cast<int64_t>(kThreads), block.run[3] - at);
  const int i = threadIdx.x;
  const bool mine = i < length;
  const float x = mine ? ToFloat(values[value + i]) : 0.0f;
  const float first = ToFloat(values[value]);  // Neutral for the unused threads.
  float lo = mine ? x : first, hi = lo, probe = mine ? x * 0.0f : 0.0f;
  BlockRange(lo, hi, probe);
  const float scale = __fdiv_rn(__fsub_rn(hi, lo), 255.0f);
  const bool finite = probe == 0.0f && !isinf(scale);
  const float inverse = scale > 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
  if (mine) {
    const float q = floorf(__fadd_rn(__fmul_rn(__fsub_rn(x, lo), inverse), 0.5f));
    bytes[code + i] = finite ? static_cast<uint8_t>(fminf(255.0f, fmaxf(0.0f, q))) : 0;
  }
  if (i == 0) {
    float* params = reinterpret_cast<float*>(bytes + param);
    params[0] = finite ? lo : __int_as_float(0x7fc00000);
    params[1] = finite ? scale : __int_as_float(0x7fc00000);
  }
}

template <typename T>
__global__ void DequantizeKernel(const uint8_t* bytes, const int64_t* table, int64_t runs,
                                 T* values) {
  const Block block = FindBlock(table, runs);
  const int64_t at = block.index * kThreads;
  const int i = threadIdx.x;
  if (at + i >= block.run[3]) return;
  const float* params = reinterpret_cast<const float*>(bytes + block.run[2] + block.index * 8);
  const float q = static_cast<float>(bytes[block.run[1] + at + i]);
  values[block.run[0] + at + i] = FromFloat<T>(__fadd_rn(params[0], __fmul_rn(q, params[1])));
}

template <typename T>
int Quantize(const void* values, uint8_t* bytes, const int64_t* table, int64_t runs, int64_t blocks,
             cudaStream_t stream) {
  QuantizeKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(values), bytes, table, runs);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int Dequantize(const uint8_t* bytes, const int64_t* table, int64_t runs, int64_t blocks,
               void* values, cudaStream_t stream) {
  DequantizeKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      bytes, table, runs, static_cast<T*>(values));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchQuantizeBlocks(ValueType type, const void* values, uint8_t* bytes, const int64_t* table,
                         int64_t runs, int64_t blocks, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ValueType::kFloat:
      return Quantize<float>(values, bytes, table, runs, blocks, s);
    case ValueType::kDouble:
      return Quantize<double>(values, bytes, table, runs, blocks, s);
    case ValueType::kHalf:
      return Quantize<__half>(values, bytes, table, runs, blocks, s);
    case ValueType::kBFloat16:
      return Quantize<__nv_bfloat16>(values, bytes, table, runs, blocks, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int LaunchDequantizeBlocks(ValueType type, const uint8_t* bytes, const int64_t* table, int64_t runs,
                           int64_t blocks, void* values, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ValueType::kFloat:
      return Dequantize<float>(bytes, table, runs, blocks, values, s);
    case ValueType::kDouble:
      return Dequantize<double>(bytes, table, runs, blocks, values, s);
    case ValueType::kHalf:
      return Dequantize<__half>(bytes, table, runs, blocks, values, s);
    case ValueType::kBFloat16:
      return Dequantize<__nv_bfloat16>(bytes, table, runs, blocks, values, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace fsdp::cuda_kernels
