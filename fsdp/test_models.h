// Small FSDP-ready models shared by the core's tests: blocks whose forward
// opens a UnitForward scope, and a net of three blocks and a head.
#ifndef FSDP_FSDP_TEST_MODELS_H_
#define FSDP_FSDP_TEST_MODELS_H_

#include <cstdint>
#include <functional>

#include "ATen/ATen.h"
#include "fsdp/fully_shard.h"
#include "fsdp/test_util.h"
#include "fsdp/unit_forward.h"
#include "torch/nn/module.h"
#include "torch/nn/modules/container/modulelist.h"
#include "torch/nn/modules/linear.h"

namespace fsdp::testing {

// Called inside every block's forward, and in backward right after each
// block's backward, with the block's index; the memory test samples there.
inline thread_local std::function<void(int)> g_in_block_forward;
inline thread_local std::function<void(int)> g_after_block_backward;

// A block: its forward opens a UnitForward scope; its math is plain.
struct BlockImpl : torch::nn::Module, ShardableModule {
  BlockImpl(int64_t in, int64_t out, int index) : index(index) {
    fc = register_module("fc", torch::nn::Linear(in, out));
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    if (g_in_block_forward) g_in_block_forward(index);
    if (g_after_block_backward && x.requires_grad()) {
      // The gradient of the block's input is ready once its backward ran.
      x.register_hook([i = index](const at::Tensor& g) {
        if (g_after_block_backward) g_after_block_backward(i);
        return g;
      });
    }
    return unit.Return(at::tanh(fc->forward(x)));
  }
  torch::nn::Linear fc{nullptr};
  int index;
};
TORCH_MODULE(Block);

// Three blocks in a ModuleList and a head the root holds itself.
struct NetImpl : torch::nn::Module, ShardableModule {
  NetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(Block(7, 13, 0));
    blocks->push_back(Block(13, 11, 1));
    blocks->push_back(Block(11, 9, 2));
    head = register_module("head", torch::nn::Linear(9, 5));
    FillDeterministically(*this);
  }
  at::Tensor forward(at::Tensor x) {
    UnitForward unit(this);
    x = unit.Input(x);
    for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
    return unit.Return(head->forward(x));
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

}  // namespace fsdp::testing

#endif  // FSDP_FSDP_TEST_MODELS_H_
