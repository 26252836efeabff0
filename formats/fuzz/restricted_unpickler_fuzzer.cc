// libFuzzer target: any bytes through the restricted unpickler, with hooks
// that accept every global and call (the most permissive caller), so every
// opcode path is reachable. tools/fuzz.sh runs it; //formats/fuzz:
// restricted_unpickler_fuzz_regression_test replays its corpus.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/restricted_unpickler.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::UnpicklerHooks hooks;
  hooks.allow_global = [](const std::string&) { return absl::OkStatus(); };
  hooks.call = [](const std::string& global, const std::vector<fsdp::PyRef>& args,
                  bool) -> absl::StatusOr<fsdp::PyRef> {
    fsdp::PyRef object = fsdp::MakePy(fsdp::PyValue::Kind::kObject);
    object->s = global;
    object->items = args;
    return object;
  };
  hooks.persistent_load = [](const fsdp::PyRef& pid) -> absl::StatusOr<fsdp::PyRef> { return pid; };
  auto value = fsdp::Unpickle(reinterpret_cast<const char*>(data), size, "fuzz", hooks);
  if (value.ok()) (void)(*value)->Get("key");
  return 0;
}
