#include "comm/block_quantization.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ATen/Dispatch.h"
#include "ATen/Functions.h"
#include "ATen/Parallel.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace {

BlockQuantizationKernels& CudaKernels() {
  static BlockQuantizationKernels kernels{nullptr, nullptr};
  return kernels;
}

enum Column { kValue = 0, kCode, kParam, kLength, kFirstBlock, kColumns };

// Checks the tensors against each other and the table's extent.
void CheckArguments(const char* what, const at::Tensor& values, const at::Tensor& bytes,
                    const BlockTable& table) {
  TORCH_CHECK(values.defined() && bytes.defined(), what, ": undefined tensor");
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), what,
              ": values must be a 1-D contiguous tensor, got shape ", values.sizes());
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble ||
                  values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16,
              what, ": values have dtype ", values.scalar_type(),
              "; supported are Float, Double, Half and BFloat16");
  TORCH_CHECK(bytes.dim() == 1 && bytes.is_contiguous() && bytes.scalar_type() == at::kByte, what,
              ": bytes must be a 1-D contiguous uint8 tensor, got ", bytes.scalar_type(),
              " of shape ", bytes.sizes());
  TORCH_CHECK(table.value_end() <= values.numel() && table.byte_end() <= bytes.numel(), what,
              ": the table's runs reach value ", table.value_end(), " and byte ", table.byte_end(),
              " but there are ", values.numel(), " values and ", bytes.numel(), " bytes");
  if (table.blocks() == 0) return;
  TORCH_CHECK(values.device() == bytes.device() && bytes.device() == table.rows().device(), what,
              ": values (", values.device(), "), bytes (", bytes.device(),
              ") and the table's rows (", table.rows().device(), ") must be on one device");
  // The device kernels read and write the parameters as floats.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(bytes.data_ptr()) % 4 == 0, what,
              ": bytes must start at a 4-byte boundary (a view at an odd offset is not)");
}

// Codes `length` values into `codes` and the block's two parameters.
template <typename T>
void QuantizeBlock(const T* v, int64_t length, uint8_t* codes, uint8_t* param_bytes) {
  float lo = static_cast<float>(v[0]), hi = lo;
  float probe = 0.0f;  // NaN once an infinity or a NaN is multiplied in.
  for (int64_t i = 0; i < length; ++i) {
    const float x = static_cast<float>(v[i]);
    probe += x * 0.0f;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  float params[2];
  const float scale = (hi - lo) / 255.0f;  // Infinite when the range overflows float32.
  if (!(probe == 0.0f) || std::isinf(scale)) {
    params[0] = params[1] = std::numeric_limits<float>::quiet_NaN();
    std::memset(codes, 0, length);
  } else {
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < length; ++i) {
      const float q = std::floor((static_cast<float>(v[i]) - lo) * inverse + 0.5f);
      codes[i] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, q)));
    }
    params[0] = lo;
    params[1] = scale;
  }
  std::memcpy(param_bytes, params, sizeof(params));
}

template <typename T>
void DequantizeBlock(const uint8_t* codes, const uint8_t* param_bytes, int64_t length, T* v) {
  float params[2];
  std::memcpy(params, param_bytes, sizeof(params));
  for (int64_t i = 0; i < length; ++i) {
    v[i] = static_cast<T>(params[0] + static_cast<float>(codes[i]) * params[1]);
  }
}

// Calls f(run row, block index within the run) for every block, in
// parallel chunks.
template <typename F>
void ForEachBlock(const BlockTable& table, F f) {
  const int64_t* rows = table.rows().data_ptr<int64_t>();
  const int64_t runs = table.runs();
  at::parallel_for(0, table.blocks(), 16, [&](int64_t begin, int64_t end) {
    // The run holding block `begin`: the last whose first block is <= it.
    int64_t lo = 0, hi = runs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (rows[mid * kColumns + kFirstBlock] <= begin) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    for (int64_t run = lo, b = begin; b < end; ++b) {
      while (run + 1 < runs && rows[(run + 1) * kColumns + kFirstBlock] <= b) ++run;
      f(rows + run * kColumns, b - rows[run * kColumns + kFirstBlock]);
    }
  });
}

}  // namespace

BlockTable::BlockTable(const std::vector<QuantizationRun>& runs) {
  std::vector<int64_t> rows;
  rows.reserve(runs.size() * kColumns);
  for (size_t i = 0; i < runs.size(); ++i) {
    const QuantizationRun& r = runs[i];
    TORCH_CHECK(r.length > 0 && r.value_offset >= 0 && r.code_offset >= 0 && r.param_offset >= 0 &&
                    r.param_offset % 4 == 0,
                "BlockTable: run ", i, " {value ", r.value_offset, ", code ", r.code_offset,
                ", param ", r.param_offset, ", length ", r.length,
                "} needs a positive length, offsets >= 0 and param a multiple of 4");
    rows.insert(rows.end(), {r.value_offset, r.code_offset, r.param_offset, r.length, blocks_});
    blocks_ += r.blocks();
    value_end_ = std::max(value_end_, r.value_offset + r.length);
    byte_end_ = std::max(
        {byte_end_, r.code_offset + r.length, r.param_offset + r.blocks() * kBlockParamBytes});
  }
  rows_ = at::tensor(rows, at::TensorOptions().dtype(at::kLong))
              .view({static_cast<int64_t>(runs.size()), kColumns});
}

BlockTable BlockTable::To(c10::Device device) const {
  BlockTable moved = *this;
  if (rows_.defined()) moved.rows_ = rows_.to(device);
  return moved;
}

bool RegisterCudaBlockQuantizationKernels(BlockQuantizationKernels kernels) {
  TORCH_CHECK(CudaKernels().quantize == nullptr,
              "the CUDA block-quantization kernels are registered twice: "
              "//comm:block_quantization_cuda is linked into this program more than once");
  CudaKernels() = kernels;
  return true;
}

bool CanQuantizeOn(c10::Device device) {
  return device.is_cpu() || (device.is_cuda() && CudaKernels().quantize != nullptr);
}

void QuantizeBlocks(const at::Tensor& values, const at::Tensor& bytes, const BlockTable& table) {
  CheckArguments("QuantizeBlocks", values, bytes, table);
  if (table.blocks() == 0) return;
  if (!values.device().is_cpu()) {
    TORCH_CHECK(CanQuantizeOn(values.device()), "QuantizeBlocks: no kernel for ", values.device(),
                " (CUDA builds link //comm:block_quantization_cuda)");
    CudaKernels().quantize(values, bytes, table);
    return;
  }
  uint8_t* out = bytes.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, values.scalar_type(), "QuantizeBlocks", [&] {
        const scalar_t* in = values.data_ptr<scalar_t>();
        ForEachBlock(table, [&](const int64_t* run, int64_t k) {
          const int64_t at = k * kQuantizationBlock;
          QuantizeBlock(in + run[kValue] + at, std::min(kQuantizationBlock, run[kLength] - at),
                        out + run[kCode] + at, out + run[kParam] + k * kBlockParamBytes);
        });
      });
}

void DequantizeBlocks(const at::Tensor& bytes, const BlockTable& table, const at::Tensor& values) {
  CheckArguments("DequantizeBlocks", values, bytes, table);
  if (table.blocks() == 0) return;
  if (!values.device().is_cpu()) {
    TORCH_CHECK(CanQuantizeOn(values.device()), "DequantizeBlocks: no kernel for ", values.device(),
                " (CUDA builds link //comm:block_quantization_cuda)");
    CudaKernels().dequantize(bytes, table, values);
    return;
  }
  const uint8_t* in = bytes.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, values.scalar_type(), "DequantizeBlocks", [&] {
        scalar_t* out = values.data_ptr<scalar_t>();
        ForEachBlock(table, [&](const int64_t* run, int64_t k) {
          const int64_t at = k * kQuantizationBlock;
          DequantizeBlock(in + run[kCode] + at, in + run[kParam] + k * kBlockParamBytes,
                          std::min(kQuantizationBlock, run[kLength] - at), out + run[kValue] + at);
        });
      });
}

}  // namespace fsdp
