#include "statedict/model_tensors.h"

#include "absl/strings/str_cat.h"

namespace fsdp::statedict_internal {
namespace {

// PyTorch's state_dict order: a module's own parameters, its own buffers,
// then its children's, recursively (a shared child under each of its
// names).
void CollectTensors(const torch::nn::Module& module, const std::string& prefix,
                    StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) {
    CollectTensors(*child.value(), prefix + child.key() + ".", out);
  }
}

}  // namespace

StateDict NamedTensors(const torch::nn::Module& module) {
  StateDict out;
  CollectTensors(module, "", out);
  return out;
}

}  // namespace fsdp::statedict_internal
