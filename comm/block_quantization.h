// Blockwise 8-bit quantization of floating-point values into bytes, for
// collectives that move fewer bytes than the values' own dtype would
// (fsdp/quantized_gather.h: the int8 all-gather of ZeRO++'s qwZ).
//
// Each block of at most kQuantizationBlock consecutive values is coded on
// its own, asymmetrically: with lo and hi its smallest and largest value,
// scale = (hi - lo) / 255 and value v becomes the byte
// q = round((v - lo) / scale), decoded as lo + q * scale (in float32, then
// cast to the destination's dtype). The error of a value is at most
// scale / 2 = (hi - lo) / 510: a block of equal values (zero padding, a
// freshly initialized LayerNorm gain) decodes exactly, and a block whose
// values sit far from zero (a gain near 1.0) keeps its spread's
// resolution, which a symmetric absmax code would lose. A block holding a
// NaN or an infinity, or whose range overflows float32 (float64 values
// beyond it, spans near its largest values), decodes to NaN throughout, so
// that a diverged value is not hidden by the code.
//
// Where things lie is a BlockTable of *runs*: a run is `length`
// consecutive values from value_offset, coded into as many bytes from
// code_offset, and cut into blocks of kQuantizationBlock values (the last
// one shorter), whose parameters (two float32: lo, scale) lie 8 bytes each,
// in order, from param_offset. value_offset indexes elements of the value
// tensor; code_offset and param_offset index bytes of the byte buffer. A
// table costs a row per run, not per block, so the tables for every rank
// of a large model stay small. Callers lay runs out so that none spans two
// tensors of different scale (fsdp/quantized_gather.h: a run per parameter
// piece), and so that no two write the same bytes.
//
// Devices: the host, and CUDA when the CUDA kernels are linked in
// (//comm:block_quantization_cuda registers them at static initialization;
// CUDA builds link it). Values, bytes and table must share a device; the
// kernels run on the current stream; `bytes` must start at a 4-byte
// boundary (the kernels access parameters as floats). Value dtypes:
// float32, float64, float16, bfloat16.
//
// Errors: a caller mistake (dtype, device, shape, a run out of range of
// the tensors given) throws c10::Error naming it.
//
// Thread safety: the functions are reentrant; a BlockTable is immutable.
#ifndef FSDP_COMM_BLOCK_QUANTIZATION_H_
#define FSDP_COMM_BLOCK_QUANTIZATION_H_

#include <cstdint>
#include <vector>

#include "ATen/core/Tensor.h"
#include "c10/core/Device.h"

namespace fsdp {

inline constexpr int64_t kQuantizationBlock = 256;
// The two float32 parameters (lo, scale) of a block.
inline constexpr int64_t kBlockParamBytes = 8;

struct QuantizationRun {
  int64_t value_offset = 0;
  int64_t code_offset = 0;
  int64_t param_offset = 0;  // A multiple of 4.
  int64_t length = 0;        // > 0.

  int64_t blocks() const { return (length + kQuantizationBlock - 1) / kQuantizationBlock; }
};

class BlockTable {
 public:
  // Throws c10::Error naming the first run with a negative offset, a
  // length of 0 or a param_offset that is not a multiple of 4.
  explicit BlockTable(const std::vector<QuantizationRun>& runs);
  BlockTable() = default;

  // The same table, its rows on `device` (where the kernels read them).
  BlockTable To(c10::Device device) const;

  int64_t runs() const { return rows_.defined() ? rows_.size(0) : 0; }
  int64_t blocks() const { return blocks_; }
  // int64 [runs, 5]: value_offset, code_offset, param_offset, length and
  // the index of the run's first block among all the table's blocks.
  const at::Tensor& rows() const { return rows_; }
  // One past the last value, code byte and parameter byte any run touches.
  int64_t value_end() const { return value_end_; }
  int64_t byte_end() const { return byte_end_; }

 private:
  at::Tensor rows_;
  int64_t blocks_ = 0;
  int64_t value_end_ = 0;
  int64_t byte_end_ = 0;
};

// Codes the values of every run of `table` into `bytes`. REQUIRES:
// `values` 1-D contiguous floating, `bytes` 1-D contiguous uint8, both
// large enough for the table.
void QuantizeBlocks(const at::Tensor& values, const at::Tensor& bytes, const BlockTable& table);

// The inverse: writes the values of every run of `table` from the codes
// and parameters `bytes` holds.
void DequantizeBlocks(const at::Tensor& bytes, const BlockTable& table, const at::Tensor& values);

// Whether QuantizeBlocks and DequantizeBlocks run on `device`'s type: the
// host always, CUDA once its kernels are registered.
bool CanQuantizeOn(c10::Device device);

// The device kernels a CUDA build provides. Each launches on the current
// stream over every block of a table whose rows are on the device.
struct BlockQuantizationKernels {
  void (*quantize)(const at::Tensor& values, const at::Tensor& bytes, const BlockTable& table);
  void (*dequantize)(const at::Tensor& bytes, const BlockTable& table, const at::Tensor& values);
};
// Called once, at static initialization, by //comm:block_quantization_cuda;
// a second registration is a program error (two copies linked in) and
// throws.
bool RegisterCudaBlockQuantizationKernels(BlockQuantizationKernels kernels);

}  // namespace fsdp

#endif  // FSDP_COMM_BLOCK_QUANTIZATION_H_
