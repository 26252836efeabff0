// A reader of Python pickles (protocols 2 to 5) that never executes
// anything: the files PyTorch writes (torch.save's data.pkl, Distributed
// Checkpoint's .metadata) are pickles, and a pickle is a program that may
// call any Python function it names.
//
// The reader builds plain values (PyValue) for the data opcodes and hands
// every use of a global to its caller's hooks, which decide what the global
// means: a tensor rebuilt from a storage, a dataclass instance, a refusal
// naming it. This is PyTorch's weights_only unpickler without Python: the
// hooks are the allow-list. What a hook does not accept is an error naming
// the global, and no opcode outside the data subset (no EXT, no INST/OBJ,
// no text-mode opcodes but GLOBAL) is read.
//
// Thread-compatible; values are not shared between calls.
#ifndef FSDP_FORMATS_RESTRICTED_UNPICKLER_H_
#define FSDP_FORMATS_RESTRICTED_UNPICKLER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

// A value of the pickled data.
struct PyValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,  // str; also bytes (kept as the raw bytes).
    kTuple,
    kList,
    kDict,
    kSet,     // set and frozenset.
    kGlobal,  // A named global, never resolved: s = "module.name".
    kObject,  // A class instance: s = its class, items = constructor
              // arguments, state = what BUILD gave it (null if nothing).
    kTensor,  // Made by a hook (a rebuilt tensor, a storage as 1-D).
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;  // Bool and int.
  double f = 0;
  std::string s;
  std::vector<PyRef> items;                      // Tuple, list, set, object arguments.
  std::vector<std::pair<PyRef, PyRef>> entries;  // Dict, in insertion order.
  PyRef state;
  at::Tensor tensor;

  PyValue() = default;
  PyValue(const PyValue&) = delete;
  PyValue& operator=(const PyValue&) = delete;
  // Releases nested values without recursing: a hostile pickle may nest
  // values a million deep.
  ~PyValue();

  // The value of a string key in a dict or a dict-state object; null if
  // absent.
  PyRef Get(const std::string& key) const;
};

PyRef MakePy(PyValue::Kind kind);
PyRef MakePyInt(int64_t v);
PyRef MakePyString(std::string s);
const char* KindName(PyValue::Kind kind);

struct UnpicklerHooks {
  // Whether the pickle may name `global` ("module.name") at all. Checked
  // where the global is named, before anything uses it; the error names
  // it. Null: any name may appear, and only the uses below decide.
  std::function<absl::Status(const std::string& global)> allow_global;
  // REDUCE (callable(*args)) and NEWOBJ (cls.__new__(cls, *args)) of a
  // global: the value it stands for, or an error naming it.
  std::function<absl::StatusOr<PyRef>(const std::string& global, const std::vector<PyRef>& args,
                                      bool newobj)>
      call;
  // BINPERSID's persistent id to a value (torch.save's storages). Null:
  // persistent ids are refused.
  std::function<absl::StatusOr<PyRef>(const PyRef& pid)> persistent_load;
};

// Reads the pickle in data[0, size). `what` names it in errors ("'x.pt':
// data.pkl"), which also give the byte offset. Errors are kInvalidArgument.
absl::StatusOr<PyRef> Unpickle(const char* data, size_t size, const std::string& what,
                               const UnpicklerHooks& hooks);

}  // namespace fsdp

#endif  // FSDP_FORMATS_RESTRICTED_UNPICKLER_H_
