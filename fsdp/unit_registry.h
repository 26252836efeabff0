// The registry: which FSDP unit a module is. Process-wide, so a module's
// forward can find its unit from `this` (UnitForward) and a second Wrap of
// an already wrapped module is refused.
//
// A model's units enter all together when its Wrap succeeds and leave when
// the model is destroyed. Thread-safe.
#ifndef FSDP_FSDP_UNIT_REGISTRY_H_
#define FSDP_FSDP_UNIT_REGISTRY_H_

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "torch/nn/module.h"

namespace fsdp {

class FsdpUnit;

// The FSDP unit `module` is, or null.
FsdpUnit* GetModuleUnit(const torch::nn::Module* module);

// Registers every (module, unit) pair, or none: returns the index of the
// first module that is a unit already, leaving the registry unchanged.
std::optional<size_t> RegisterUnits(
    const std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>>& units);
// Removes each module's entry if it maps to that unit, so that a model
// whose registration failed cannot remove another model's entries.
void UnregisterUnits(const std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>>& units);

}  // namespace fsdp

#endif  // FSDP_FSDP_UNIT_REGISTRY_H_
