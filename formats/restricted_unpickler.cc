#include "formats/restricted_unpickler.h"

#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace fsdp {

PyValue::~PyValue() {
  std::vector<PyRef> pending;
  const auto take = [&pending](PyValue& v) {
    for (PyRef& item : v.items) pending.push_back(std::move(item));
    for (auto& [key, value] : v.entries) {
      pending.push_back(std::move(key));
      pending.push_back(std::move(value));
    }
    if (v.state != nullptr) pending.push_back(std::move(v.state));
    v.items.clear();
    v.entries.clear();
  };
  take(*this);
  while (!pending.empty()) {
    PyRef next = std::move(pending.back());
    pending.pop_back();
    // The last owner empties it here, so its destructor finds nothing to
    // recurse into.
    if (next != nullptr && next.use_count() == 1) take(*next);
  }
}

PyRef PyValue::Get(const std::string& key) const {
  const PyValue* dict = this;
  if (kind == Kind::kObject) {
    if (state == nullptr || state->kind != Kind::kDict) return nullptr;
    dict = state.get();
  }
  if (dict->kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : dict->entries) {
    if (k->kind == Kind::kString && k->s == key) return v;
  }
  return nullptr;
}

PyRef MakePy(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

PyRef MakePyInt(int64_t v) {
  PyRef r = MakePy(PyValue::Kind::kInt);
  r->i = v;
  return r;
}

PyRef MakePyString(std::string s) {
  PyRef r = MakePy(PyValue::Kind::kString);
  r->s = std::move(s);
  return r;
}

const char* KindName(PyValue::Kind kind) {
  switch (kind) {
    case PyValue::Kind::kNone:
      return "None";
    case PyValue::Kind::kBool:
      return "bool";
    case PyValue::Kind::kInt:
      return "int";
    case PyValue::Kind::kFloat:
      return "float";
    case PyValue::Kind::kString:
      return "str";
    case PyValue::Kind::kTuple:
      return "tuple";
    case PyValue::Kind::kList:
      return "list";
    case PyValue::Kind::kDict:
      return "dict";
    case PyValue::Kind::kSet:
      return "set";
    case PyValue::Kind::kGlobal:
      return "global";
    case PyValue::Kind::kObject:
      return "object";
    case PyValue::Kind::kTensor:
      return "tensor";
  }
  return "?";
}

namespace {

class Unpickler {
 public:
  Unpickler(const char* data, size_t size, const std::string& what, const UnpicklerHooks& hooks)
      : data_(data), size_(size), what_(what), hooks_(hooks) {}

  absl::StatusOr<PyRef> Run() {
    while (true) {
      uint8_t op = 0;
      FSDP_RETURN_IF_ERROR(ReadByte(&op));
      if (op == '.') break;  // STOP
      FSDP_RETURN_IF_ERROR(Step(op));
    }
    if (stack_.size() != 1 || !marks_.empty()) {
      return Error("the pickle does not end with one value");
    }
    return stack_.back();
  }

 private:
  absl::Status Error(const std::string& problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": ", PrintableText(problem), " (at byte ", pos_, ")"));
  }
  // A hook's error, placed. Problems quote what the pickle holds, which may
  // be any bytes.
  absl::Status Placed(const absl::Status& status) const {
    return absl::Status(status.code(), absl::StrCat(what_, ": ", PrintableText(status.message()),
                                                    " (at byte ", pos_, ")"));
  }
  absl::Status ReadByte(uint8_t* out) {
    if (pos_ >= size_) return Error("the pickle ends early");
    *out = static_cast<uint8_t>(data_[pos_++]);
    return absl::OkStatus();
  }
  absl::Status ReadBytes(uint64_t n, std::string* out) {
    if (n > size_ - pos_) return Error("the pickle ends early");
    out->assign(data_ + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> ReadUint(size_t n) {
    if (n > size_ - pos_) return Error("the pickle ends early");
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + k])) << (8 * k);
    pos_ += n;
    return v;
  }
  absl::StatusOr<std::string> ReadLine() {
    const size_t start = pos_;
    while (pos_ < size_ && data_[pos_] != '\n') ++pos_;
    if (pos_ >= size_) return Error("the pickle ends inside a GLOBAL");
    return std::string(data_ + start, pos_++ - start);
  }
  absl::StatusOr<PyRef> Pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) {
      return Error("pickle stack underflow");
    }
    PyRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  absl::StatusOr<std::vector<PyRef>> PopToMark() {
    if (marks_.empty()) return Error("pickle MARK missing");
    std::vector<PyRef> items(stack_.begin() + marks_.back(), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  absl::StatusOr<PyRef> Top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) {
      return Error("pickle stack underflow");
    }
    return stack_.back();
  }
  void Push(PyRef v) { stack_.push_back(std::move(v)); }
  // NOTE [No recursive values]. Values are shared_ptrs, so a value that
  // contains itself (Python's l.append(l), rebuilt through the memo) would
  // never be freed: a pickle could leak memory at will (the fuzzer's first
  // finding). No file we read holds one, and a cycle can only close by
  // changing a value after it was placed inside another, so that is
  // refused: every value placed in a container, a tuple, an object's state
  // or a hook's arguments is marked, and marked values are never changed.
  // The set holds its values, so no address in it is reused while reading.
  void Contain(const PyRef& v) { contained_.insert(v); }
  absl::Status CheckChangeable(const PyRef& target, const char* op) const {
    if (contained_.count(target) > 0) {
      return Error(absl::StrCat(op, " changes a ", KindName(target->kind),
                                " already placed inside another value (a recursive structure, "
                                "which these files never hold)"));
    }
    return absl::OkStatus();
  }
  PyRef Tuple(std::vector<PyRef> items) {
    for (const PyRef& item : items) Contain(item);
    PyRef r = MakePy(PyValue::Kind::kTuple);
    r->items = std::move(items);
    return r;
  }
  absl::Status Memoize(uint64_t index) {
    FSDP_ASSIGN_OR_RETURN(PyRef top, Top());
    memo_[index] = std::move(top);
    return absl::OkStatus();
  }
  absl::Status Recall(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) return Error(absl::StrCat("memo ", index, " was never stored"));
    Push(it->second);
    return absl::OkStatus();
  }
  absl::Status PushGlobal(std::string name) {
    if (hooks_.allow_global) {
      absl::Status allowed = hooks_.allow_global(name);
      if (!allowed.ok()) return Placed(allowed);
    }
    PyRef g = MakePy(PyValue::Kind::kGlobal);
    g->s = std::move(name);
    Push(std::move(g));
    return absl::OkStatus();
  }
  absl::Status Call(bool newobj) {
    FSDP_ASSIGN_OR_RETURN(PyRef args, Pop());
    FSDP_ASSIGN_OR_RETURN(PyRef callable, Pop());
    if (callable->kind != PyValue::Kind::kGlobal || args->kind != PyValue::Kind::kTuple) {
      return Error(absl::StrCat(newobj ? "NEWOBJ" : "REDUCE", " of a ", KindName(callable->kind),
                                " with a ", KindName(args->kind), ", not of a global"));
    }
    if (!hooks_.call) return Error(absl::StrCat("the pickle calls ", callable->s));
    for (const PyRef& arg : args->items) Contain(arg);
    absl::StatusOr<PyRef> result = hooks_.call(callable->s, args->items, newobj);
    if (!result.ok()) return Placed(result.status());
    Push(*std::move(result));
    return absl::OkStatus();
  }
  absl::Status SetItems(const std::vector<PyRef>& kv) {
    FSDP_ASSIGN_OR_RETURN(PyRef dict, Top());
    if (dict->kind != PyValue::Kind::kDict) return Error("SETITEM(S) on a non-dict");
    if (kv.size() % 2 != 0) return Error("SETITEMS with an odd number of values");
    FSDP_RETURN_IF_ERROR(CheckChangeable(dict, "SETITEM(S)"));
    for (const PyRef& v : kv) {
      if (v == dict) return Error("SETITEM(S) puts a dict inside itself");
      Contain(v);
    }
    for (size_t k = 0; k < kv.size(); k += 2) dict->entries.emplace_back(kv[k], kv[k + 1]);
    return absl::OkStatus();
  }
  absl::Status Append(std::vector<PyRef> values, PyValue::Kind kind, const char* op) {
    FSDP_ASSIGN_OR_RETURN(PyRef target, Top());
    if (target->kind != kind) {
      return Error(absl::StrCat(op, " to a ", KindName(target->kind)));
    }
    FSDP_RETURN_IF_ERROR(CheckChangeable(target, op));
    for (const PyRef& v : values) {
      if (v == target) return Error(absl::StrCat(op, " puts a value inside itself"));
      Contain(v);
    }
    for (PyRef& v : values) target->items.push_back(std::move(v));
    return absl::OkStatus();
  }
  absl::Status PushString(size_t width) {
    FSDP_ASSIGN_OR_RETURN(uint64_t n, ReadUint(width));
    std::string s;
    FSDP_RETURN_IF_ERROR(ReadBytes(n, &s));
    Push(MakePyString(std::move(s)));
    return absl::OkStatus();
  }

  absl::Status Step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        FSDP_ASSIGN_OR_RETURN(uint64_t version, ReadUint(1));
        if (version > 5) return Error(absl::StrCat("pickle protocol ", version));
        return absl::OkStatus();
      }
      case 0x95: {  // FRAME: a length prefix for buffering; nothing to do.
        FSDP_ASSIGN_OR_RETURN(uint64_t ignored, ReadUint(8));
        (void)ignored;
        return absl::OkStatus();
      }
      case '}':
        Push(MakePy(PyValue::Kind::kDict));
        return absl::OkStatus();
      case ']':
        Push(MakePy(PyValue::Kind::kList));
        return absl::OkStatus();
      case ')':
        Push(Tuple({}));
        return absl::OkStatus();
      case 0x8f:
        Push(MakePy(PyValue::Kind::kSet));
        return absl::OkStatus();  // EMPTY_SET
      case 'N':
        Push(MakePy(PyValue::Kind::kNone));
        return absl::OkStatus();
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        PyRef b = MakePy(PyValue::Kind::kBool);
        b->i = op == 0x88;
        Push(std::move(b));
        return absl::OkStatus();
      }
      case '(':
        marks_.push_back(stack_.size());
        return absl::OkStatus();
      case '0':
        return Pop().status();  // POP
      case '1':
        return PopToMark().status();  // POP_MARK
      case '2': {                     // DUP
        FSDP_ASSIGN_OR_RETURN(PyRef top, Top());
        Push(std::move(top));
        return absl::OkStatus();
      }
      case 'K': {  // BININT1
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(1));
        Push(MakePyInt(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'M': {  // BININT2
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(2));
        Push(MakePyInt(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'J': {  // BININT
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(4));
        Push(MakePyInt(static_cast<int32_t>(static_cast<uint32_t>(v))));
        return absl::OkStatus();
      }
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes.
        FSDP_ASSIGN_OR_RETURN(uint64_t n, ReadUint(1));
        if (n > 8) return Error("an integer wider than 64 bits");
        FSDP_ASSIGN_OR_RETURN(uint64_t v, ReadUint(n));
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
        Push(MakePyInt(static_cast<int64_t>(v)));
        return absl::OkStatus();
      }
      case 'G': {  // BINFLOAT, big-endian.
        FSDP_ASSIGN_OR_RETURN(uint64_t le, ReadUint(8));
        uint64_t be = 0;
        for (int k = 0; k < 8; ++k) be |= ((le >> (8 * k)) & 0xff) << (8 * (7 - k));
        PyRef f = MakePy(PyValue::Kind::kFloat);
        std::memcpy(&f->f, &be, 8);
        Push(std::move(f));
        return absl::OkStatus();
      }
      case 0x8c:
        return PushString(1);  // SHORT_BINUNICODE
      case 'U':
        return PushString(1);  // SHORT_BINSTRING
      case 'C':
        return PushString(1);  // SHORT_BINBYTES
      case 'X':
        return PushString(4);  // BINUNICODE
      case 'T':
        return PushString(4);  // BINSTRING
      case 'B':
        return PushString(4);  // BINBYTES
      case 0x8d:
        return PushString(8);  // BINUNICODE8
      case 0x8e:
        return PushString(8);  // BINBYTES8
      case 'q': {
        FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(1));
        return Memoize(i);
      }
      case 'r': {
        FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(4));
        return Memoize(i);
      }
      case 0x94:
        return Memoize(memo_.size());  // MEMOIZE
      case 'h': {
        FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(1));
        return Recall(i);
      }
      case 'j': {
        FSDP_ASSIGN_OR_RETURN(uint64_t i, ReadUint(4));
        return Recall(i);
      }
      case 'c': {  // GLOBAL
        FSDP_ASSIGN_OR_RETURN(std::string module, ReadLine());
        FSDP_ASSIGN_OR_RETURN(std::string name, ReadLine());
        return PushGlobal(module + "." + name);
      }
      case 0x93: {  // STACK_GLOBAL
        FSDP_ASSIGN_OR_RETURN(PyRef name, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef module, Pop());
        if (name->kind != PyValue::Kind::kString || module->kind != PyValue::Kind::kString) {
          return Error("STACK_GLOBAL of non-strings");
        }
        return PushGlobal(module->s + "." + name->s);
      }
      case 't': {
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopToMark());
        Push(Tuple(std::move(items)));
        return absl::OkStatus();
      }
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        std::vector<PyRef> items(op - 0x84);
        for (size_t k = items.size(); k > 0; --k) {
          FSDP_ASSIGN_OR_RETURN(items[k - 1], Pop());
        }
        Push(Tuple(std::move(items)));
        return absl::OkStatus();
      }
      case 0x91: {  // FROZENSET
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> items, PopToMark());
        for (const PyRef& item : items) Contain(item);
        PyRef set = MakePy(PyValue::Kind::kSet);
        set->items = std::move(items);
        Push(std::move(set));
        return absl::OkStatus();
      }
      case 'Q': {  // BINPERSID
        FSDP_ASSIGN_OR_RETURN(PyRef pid, Pop());
        if (!hooks_.persistent_load) return Error("a persistent id, which this file never needs");
        Contain(pid);
        absl::StatusOr<PyRef> value = hooks_.persistent_load(pid);
        if (!value.ok()) return Placed(value.status());
        Push(*std::move(value));
        return absl::OkStatus();
      }
      case 'R':
        return Call(/*newobj=*/false);  // REDUCE
      case 0x81:
        return Call(/*newobj=*/true);  // NEWOBJ
      case 0x92: {                     // NEWOBJ_EX: cls, args, kwargs
        FSDP_ASSIGN_OR_RETURN(PyRef kwargs, Pop());
        if (kwargs->kind != PyValue::Kind::kDict || !kwargs->entries.empty()) {
          return Error("NEWOBJ_EX with keyword arguments");
        }
        return Call(/*newobj=*/true);
      }
      case 'b': {  // BUILD
        FSDP_ASSIGN_OR_RETURN(PyRef state, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef target, Top());
        if (target->kind == PyValue::Kind::kObject) {
          FSDP_RETURN_IF_ERROR(CheckChangeable(target, "BUILD"));
          if (target->state != nullptr) return Error("BUILD of an object that has its state");
          if (state == target) return Error("BUILD puts an object inside itself");
          Contain(state);
          target->state = std::move(state);
          return absl::OkStatus();
        }
        // An OrderedDict's _metadata, a tensor's Python attributes: not data.
        if (target->kind == PyValue::Kind::kDict || target->kind == PyValue::Kind::kTensor) {
          return absl::OkStatus();
        }
        return Error(absl::StrCat("BUILD on a ", KindName(target->kind)));
      }
      case 's': {  // SETITEM
        FSDP_ASSIGN_OR_RETURN(PyRef value, Pop());
        FSDP_ASSIGN_OR_RETURN(PyRef key, Pop());
        return SetItems({std::move(key), std::move(value)});
      }
      case 'u': {  // SETITEMS
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> kv, PopToMark());
        return SetItems(kv);
      }
      case 'a': {  // APPEND
        FSDP_ASSIGN_OR_RETURN(PyRef value, Pop());
        return Append({std::move(value)}, PyValue::Kind::kList, "APPEND");
      }
      case 'e': {  // APPENDS
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> values, PopToMark());
        return Append(std::move(values), PyValue::Kind::kList, "APPENDS");
      }
      case 0x90: {  // ADDITEMS
        FSDP_ASSIGN_OR_RETURN(std::vector<PyRef> values, PopToMark());
        return Append(std::move(values), PyValue::Kind::kSet, "ADDITEMS");
      }
      default:
        return Error(absl::StrCat("unsupported pickle opcode 0x", absl::Hex(op)));
    }
  }

  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& what_;
  const UnpicklerHooks& hooks_;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
  std::unordered_set<PyRef> contained_;
};

}  // namespace

absl::StatusOr<PyRef> Unpickle(const char* data, size_t size, const std::string& what,
                               const UnpicklerHooks& hooks) {
  return Unpickler(data, size, what, hooks).Run();
}

}  // namespace fsdp
