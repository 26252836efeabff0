#include "fsdp/unit_registry.h"

#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<const torch::nn::Module*, FsdpUnit*>& Registry() {
  static auto* registry = new std::unordered_map<const torch::nn::Module*, FsdpUnit*>();
  return *registry;
}

}  // namespace

FsdpUnit* GetModuleUnit(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(module);
  return it == Registry().end() ? nullptr : it->second;
}

std::optional<size_t> RegisterUnits(
    const std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>>& units) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (size_t i = 0; i < units.size(); ++i) {
    if (Registry().count(units[i].first) != 0) return i;
  }
  for (const auto& [module, unit] : units) Registry()[module] = unit;
  return std::nullopt;
}

void UnregisterUnits(const std::vector<std::pair<const torch::nn::Module*, FsdpUnit*>>& units) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (const auto& [module, unit] : units) {
    auto it = Registry().find(module);
    if (it != Registry().end() && it->second == unit) Registry().erase(it);
  }
}

}  // namespace fsdp
