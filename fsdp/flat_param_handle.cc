#include "fsdp/flat_param_handle.h"

#include <algorithm>
#include <exception>
#include <set>
#include <utility>

#include "ATen/ATen.h"
#include "ATen/core/grad_mode.h"
#include "ATen/native/Resize.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "c10/core/DeviceGuard.h"
#include "c10/core/impl/VirtualGuardImpl.h"
#include "c10/util/Exception.h"

namespace fsdp {
namespace {

// On a device with streams the caching allocator hands memory back to the
// stream it was allocated on as soon as it is freed; memory that another
// stream used must not be reused before that stream's work so far is done.
// Records `t`'s use by the current stream (PyTorch's record_stream); a no-op
// on CPU, where work is synchronous.
void RecordUseOnCurrentStream(const at::Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(t.device().type());
  guard.recordDataPtrOnStream(t.storage().data_ptr(), guard.getStream(t.device()));
}

// Frees (bytes == 0) or allocates the whole storage of `t`, keeping the
// storage object so that every view of it stays valid across the cycle.
// The contents are not kept.
void ResizeStorage(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->device_type() == c10::DeviceType::CPU) {
    at::native::resize_bytes_cpu(storage, bytes);
    return;
  }
  // The device's allocator allocates on the current device.
  c10::DeviceGuard on_device(storage->device());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

// The full parameter is filled on the all-gather stream and read on the
// current (compute) stream, which its free waits for.
void FreeStorage(const at::Tensor& t) {
  RecordUseOnCurrentStream(t);
  ResizeStorage(t, 0);
}

void AllocateStorage(const at::Tensor& t) { ResizeStorage(t, t.numel() * t.element_size()); }

// Waits for every work (none is left running with its buffers about to be
// freed) and then throws the first error, if any.
void WaitAll(std::vector<std::unique_ptr<CollectiveWork>> works) {
  std::exception_ptr first_error;
  for (const auto& work : works) {
    try {
      work->Wait();
    } catch (...) {
      if (first_error == nullptr) first_error = std::current_exception();
    }
  }
  if (first_error != nullptr) std::rethrow_exception(first_error);
}

}  // namespace

const char* HandleTrainingStateName(HandleTrainingState state) {
  switch (state) {
    case HandleTrainingState::kIdle:
      return "IDLE";
    case HandleTrainingState::kForward:
      return "FORWARD";
    case HandleTrainingState::kBackwardPre:
      return "BACKWARD_PRE";
    case HandleTrainingState::kBackwardPost:
      return "BACKWARD_POST";
    case HandleTrainingState::kSummonFullParams:
      return "SUMMON_FULL_PARAMS";
  }
  return "invalid";
}

absl::Status FlatParamHandle::CheckParams(const std::string& unit_name,
                                          const std::vector<FlatParamEntry>& params,
                                          const Collectives& group) {
  const std::string who = absl::StrCat("unit '", unit_name, "' on rank ", group.rank(),
                                       " of ", group.world_size());
  if (params.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": a unit needs parameters"));
  }
  std::vector<std::string> problems;
  std::set<const void*> seen;
  const FlatParamEntry& first = params.front();
  for (const FlatParamEntry& p : params) {
    if (!p.param.defined()) {
      problems.push_back(absl::StrCat("'", p.fqn, "' is an undefined tensor"));
      continue;
    }
    if (!seen.insert(p.param.unsafeGetTensorImpl()).second) {
      problems.push_back(absl::StrCat(
          "'", p.fqn, "' is a parameter already in this unit under another name "
          "(shared parameters belong to one unit, once)"));
    }
    if (!p.param.is_leaf()) {
      problems.push_back(absl::StrCat("'", p.fqn, "' is not a leaf tensor"));
    }
    if (!first.param.defined()) continue;
    if (p.param.scalar_type() != first.param.scalar_type()) {
      problems.push_back(absl::StrCat("'", p.fqn, "' has dtype ",
                                      c10::toString(p.param.scalar_type()), " but '",
                                      first.fqn, "' has ",
                                      c10::toString(first.param.scalar_type())));
    }
    if (p.param.device() != first.param.device()) {
      problems.push_back(absl::StrCat("'", p.fqn, "' is on ", p.param.device().str(),
                                      " but '", first.fqn, "' is on ",
                                      first.param.device().str()));
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": cannot flatten parameters: ",
                                                   absl::StrJoin(problems, "; ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FlatParamHandle>> FlatParamHandle::Create(
    std::string unit_name, std::vector<FlatParamEntry> params, Collectives& group,
    const FlatParamHandleOptions& options) {
  FSDP_RETURN_IF_ERROR(CheckParams(unit_name, params, group));
  if (IsHybrid(options.strategy) && options.replicate_group == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit '", unit_name, "': ", ShardingStrategyName(options.strategy),
        " needs a replicate group (FsdpOptions::replicate_group) besides the shard group"));
  }
  return std::unique_ptr<FlatParamHandle>(
      new FlatParamHandle(std::move(unit_name), std::move(params), group, options));
}

FlatParamHandle::FlatParamHandle(std::string unit_name, std::vector<FlatParamEntry> params,
                                 Collectives& group, const FlatParamHandleOptions& options)
    : unit_name_(std::move(unit_name)),
      params_(std::move(params)),
      group_(group),
      options_(options),
      compute_device_(params_.front().param.device()),
      divide_factor_(options.gradient_divide_factor) {
  LayOut();
  // Flatten the current values (identical on every rank: the caller's
  // contract) and keep this rank's part.
  const at::TensorOptions tensor_options = params_.front().param.options().requires_grad(false);
  at::Tensor flat = at::zeros({padded_numel_}, tensor_options);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      flat.narrow(0, infos_[i].offset, infos_[i].numel)
          .copy_(params_[i].param.detach().reshape({-1}));
    }
  }
  const int rank = uses_sharded_views() ? group_.rank() : 0;
  std::vector<at::Tensor> mine;
  for (const Segment& seg : segments_) {
    mine.push_back(flat.narrow(0, seg.full_begin + rank * seg.shard_numel, seg.shard_numel));
  }
  if (options_.offload_params) {
    const at::Tensor shard = at::cat(mine);
    local_shard_ = EmptyOnHost(shard.numel(), shard.scalar_type());
    local_shard_.copy_(shard);
  } else {
    local_shard_ = at::cat(mine);
  }
  // The views parameters swap between are made once: building a view costs
  // about as much as the swap itself, and views of full_ stay valid while
  // its storage is freed and reallocated.
  for (size_t i = 0; i < params_.size(); ++i) shard_views_.push_back(ShardViewOf(local_shard_, i));
  compute_dtype_ = options_.param_dtype.value_or(local_shard_.scalar_type());
  low_precision_ = compute_dtype_ != local_shard_.scalar_type();
  if (uses_sharded_views() || low_precision_ || options_.offload_params) {
    // The flat copy (on the compute device), no longer needed, serves as
    // the full buffer when the dtypes agree: one unit's memory less at wrap
    // time.
    full_ = low_precision_ ? at::empty({padded_numel_}, tensor_options.dtype(compute_dtype_))
                           : flat;
    for (const FlatParamInfo& info : infos_) {  // Views need the storage allocated.
      full_views_.push_back(full_.narrow(0, info.offset, info.numel).view(info.shape));
    }
    FreeStorage(full_);
  }
  flat = at::Tensor();
  PointParamsAtShard();
}

FlatParamHandle::~FlatParamHandle() = default;

void FlatParamHandle::LayOut() {
  const int world = uses_sharded_views() ? group_.world_size() : 1;
  const int rank = uses_sharded_views() ? group_.rank() : 0;
  int64_t group_numel[2] = {0, 0};  // Frozen, trainable.
  for (const FlatParamEntry& p : params_) group_numel[p.param.requires_grad()] += p.param.numel();
  flat_numel_ = group_numel[0] + group_numel[1];
  trainable_numel_ = group_numel[1];
  // A segment per group with elements (one, frozen, when no parameter has
  // any), so that only a real mix costs a second all-gather.
  int64_t shard_numel = 0;
  for (const bool trainable : {true, false}) {
    const int64_t numel = group_numel[trainable];
    if (numel == 0 && !(segments_.empty() && !trainable)) continue;
    Segment seg;
    seg.trainable = trainable;
    seg.full_begin = padded_numel_;
    seg.shard_begin = shard_numel;
    seg.shard_numel = (numel + world - 1) / world;
    seg.padded_numel = seg.shard_numel * world;
    padded_numel_ += seg.padded_numel;
    shard_numel += seg.shard_numel;
    segments_.push_back(seg);
  }
  // Each parameter in its group's segment, in order; an empty one whose
  // group has no segment in the other (it takes no room).
  infos_.resize(params_.size());
  segment_of_.assign(params_.size(), 0);
  std::vector<int64_t> filled(segments_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    FlatParamInfo& info = infos_[i];
    info.fqn = params_[i].fqn;
    info.shape = params_[i].param.sizes().vec();
    info.trainable = params_[i].param.requires_grad();
    info.numel = params_[i].param.numel();
    for (size_t s = 0; s < segments_.size(); ++s) {
      if (segments_[s].trainable == info.trainable) segment_of_[i] = s;
    }
    const Segment& seg = segments_[segment_of_[i]];
    info.offset = seg.full_begin + filled[segment_of_[i]];
    filled[segment_of_[i]] += info.numel;
    const int64_t owned = seg.full_begin + rank * seg.shard_numel;
    const int64_t begin = std::max(info.offset, owned);
    const int64_t end = std::min(info.offset + info.numel, owned + seg.shard_numel);
    info.shard_offset = end > begin ? begin - info.offset : 0;
    info.shard_numel = std::max<int64_t>(0, end - begin);
  }
}

std::vector<std::unique_ptr<CollectiveWork>> FlatParamHandle::AllGatherSegments(
    const at::Tensor& full, const at::Tensor& shard, size_t count) const {
  std::vector<std::unique_ptr<CollectiveWork>> works;
  try {
    for (size_t s = 0; s < count; ++s) {
      const Segment& seg = segments_[s];
      works.push_back(group_.AllGatherIntoTensor(
          full.narrow(0, seg.full_begin, seg.padded_numel),
          shard.narrow(0, seg.shard_begin, seg.shard_numel)));
    }
  } catch (...) {
    // Issuing one failed: the ones issued still write into `full`.
    try {
      WaitAll(std::move(works));
    } catch (...) {
    }
    throw;
  }
  return works;
}

int64_t FlatParamHandle::trainable_shard_numel() const {
  return has_trainable_params() ? segments_.front().shard_numel : 0;
}

at::Tensor FlatParamHandle::AllGatherShardLike(const at::Tensor& flat) const {
  const bool trainable_only = flat.numel() == trainable_shard_numel() && has_trainable_params();
  TORCH_CHECK(flat.dim() == 1 && (trainable_only || flat.numel() == shard_numel()), Describe(),
              ": AllGatherShardLike takes ", trainable_shard_numel(), " or ", shard_numel(),
              " elements, not ", flat.numel());
  if (!uses_sharded_views()) return flat;
  const size_t count = trainable_only ? 1 : segments_.size();
  const Segment& last = segments_[count - 1];
  at::Tensor full = at::empty({last.full_begin + last.padded_numel}, flat.options());
  WaitAll(AllGatherSegments(full, flat, count));
  return full;
}

at::Tensor FlatParamHandle::FullViewOf(const at::Tensor& full, size_t i) const {
  return full.narrow(0, infos_[i].offset, infos_[i].numel).view(infos_[i].shape);
}

std::string FlatParamHandle::Describe() const {
  return absl::StrCat("unit '", unit_name_, "' on rank ", group_.rank(), " of ",
                      group_.world_size());
}

bool FlatParamHandle::KeptFullMatchesShard() const {
  if (!full_kept_) return true;
  at::NoGradGuard no_grad;
  const at::Tensor shard = OnComputeDevice(local_shard_, compute_dtype_);
  if (!uses_sharded_views()) return at::equal(full_, shard);
  for (const Segment& seg : segments_) {
    const at::Tensor mine =
        full_.narrow(0, seg.full_begin + group_.rank() * seg.shard_numel, seg.shard_numel);
    if (!at::equal(mine, shard.narrow(0, seg.shard_begin, seg.shard_numel))) return false;
  }
  return true;
}

void FlatParamHandle::SetGradientDivideFactor(std::optional<double> factor) {
  TORCH_CHECK(!factor || *factor > 0, Describe(),
              ": the gradient divide factor must be positive, got ", factor ? *factor : 0.0);
  divide_factor_ = factor;
}

void FlatParamHandle::Transition(HandleTrainingState from, HandleTrainingState to) {
  TORCH_CHECK(training_state_ == from, Describe(), ": cannot enter ",
              HandleTrainingStateName(to), " from ", HandleTrainingStateName(training_state_),
              " (expected ", HandleTrainingStateName(from), ")");
  training_state_ = to;
}

void FlatParamHandle::PointParamsAtFull() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].param.set_data(full_views_[i]);
}

at::Tensor FlatParamHandle::ShardViewOf(const at::Tensor& flat, size_t i) const {
  const FlatParamInfo& info = infos_[i];
  // NO_SHARD: W = 1, so the shard is the flat parameter, segments unpadded.
  if (!uses_sharded_views()) return FullViewOf(flat, i);
  if (info.shard_numel == 0) return flat.narrow(0, 0, 0);
  const Segment& seg = segments_[segment_of_[i]];
  const int64_t owned = seg.full_begin + group_.rank() * seg.shard_numel;
  return flat.narrow(0, seg.shard_begin + info.offset + info.shard_offset - owned,
                     info.shard_numel);
}

void FlatParamHandle::PointParamsAtShard() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].param.set_data(shard_views_[i]);
}

void FlatParamHandle::AllocateShardedGrad(at::Tensor initial) {
  const int64_t numel = trainable_shard_numel();
  sharded_grad_ = initial.defined() ? std::move(initial)
                                    : options_.offload_params
                                        ? EmptyOnHost(numel, GradDtype()).zero_()
                                        : at::zeros({numel},
                                                    local_shard_.options().dtype(GradDtype()));
  grad_aliases_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!infos_[i].trainable) {
      grad_aliases_.emplace_back();
      continue;
    }
    const at::Tensor part = ShardViewOf(sharded_grad_, i);
    grad_aliases_.push_back(at::empty({0}, part.options())
                                .set_(part.storage(), part.storage_offset(), part.sizes(),
                                      part.strides()));
  }
}

void FlatParamHandle::PublishGradients() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (infos_[i].trainable) params_[i].param.mutable_grad() = grad_aliases_[i];
  }
  gradients_pending_ = false;
}

int64_t FlatParamHandle::full_param_bytes() const {
  int64_t bytes = full_.defined() ? static_cast<int64_t>(full_.storage().nbytes()) : 0;
  if (summon_full_.defined()) bytes += static_cast<int64_t>(summon_full_.storage().nbytes());
  if (post_forward_shard_.defined()) {
    bytes += static_cast<int64_t>(post_forward_shard_.storage().nbytes());
  }
  return bytes;
}

bool FlatParamHandle::UnshardNeeded() const {
  return uses_sharded_views() || ((low_precision_ || options_.offload_params) &&
                                  training_state_ != HandleTrainingState::kSummonFullParams);
}

at::Tensor FlatParamHandle::OnComputeDevice(const at::Tensor& host, at::ScalarType dtype) const {
  if (!options_.offload_params) return host.to(dtype);
  // A copy even when the compute device is the host: one code path.
  return host.to(compute_device_, dtype, /*non_blocking=*/true, /*copy=*/true);
}

at::Tensor FlatParamHandle::EmptyOnHost(int64_t numel, at::ScalarType dtype) const {
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(
                                compute_device_.type() == c10::DeviceType::CUDA));
}

int64_t FlatParamHandle::ShardBytesOn(c10::DeviceType type) const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&local_shard_, &sharded_grad_}) {
    if (t->defined() && t->device().type() == type) {
      bytes += static_cast<int64_t>(t->storage().nbytes());
    }
  }
  return bytes;
}

at::ScalarType FlatParamHandle::GradDtype() const {
  return options_.keep_low_precision_grads
             ? options_.reduce_dtype.value_or(compute_dtype_)
             : local_shard_.scalar_type();
}

void FlatParamHandle::SnapshotShard() {
  at::NoGradGuard no_grad;
  shard_snapshot_ = local_shard_.clone();
}

void FlatParamHandle::StartUnshard() {
  // NO_SHARD's low-precision copy is a local cast, made in FinishUnshard.
  if (!uses_sharded_views() || unsharded_ || full_kept_ || has_pending_unshard()) return;
  const bool copies = low_precision_ || options_.offload_params;
  const at::Tensor& shard = shard_snapshot_.defined() ? shard_snapshot_ : local_shard_;
  try {
    if (low_precision_ && training_state_ == HandleTrainingState::kSummonFullParams) {
      summon_full_ = at::empty({padded_numel_}, local_shard_.options().device(compute_device_));
      if (options_.offload_params) {
        send_buffer_ = OnComputeDevice(local_shard_, local_shard_.scalar_type());
      }
      pending_unshard_ = AllGatherSegments(
          summon_full_, options_.offload_params ? send_buffer_ : local_shard_, segments_.size());
      return;
    }
    AllocateStorage(full_);
    if (post_forward_shard_.defined() &&
        training_state_ != HandleTrainingState::kSummonFullParams) {
      // Made on the compute stream, read by this all-gather, dropped after it.
      RecordUseOnCurrentStream(post_forward_shard_);
      Collectives& post = *options_.post_forward_group;
      int64_t begin = 0;
      for (const Segment& seg : segments_) {
        const int64_t piece = seg.padded_numel / post.world_size();
        pending_unshard_.push_back(
            post.AllGatherIntoTensor(full_.narrow(0, seg.full_begin, seg.padded_numel),
                                     post_forward_shard_.narrow(0, begin, piece)));
        begin += piece;
      }
      return;
    }
    if (copies) send_buffer_ = OnComputeDevice(shard, compute_dtype_);
    RecordUseOnCurrentStream(shard_snapshot_);  // Made on compute, read here.
    pending_unshard_ = AllGatherSegments(full_, copies ? send_buffer_ : shard, segments_.size());
  } catch (...) {
    // Nothing issued is still running (AllGatherSegments waited; the
    // post-forward all-gathers are waited for here): sharded with nothing
    // allocated, as before, and the next unshard gathers the shards.
    try {
      WaitAll(std::move(pending_unshard_));
    } catch (...) {
    }
    pending_unshard_.clear();
    post_forward_shard_ = at::Tensor();
    shard_snapshot_ = at::Tensor();
    send_buffer_ = at::Tensor();
    summon_full_ = at::Tensor();
    FreeStorage(full_);
    throw;
  }
}

void FlatParamHandle::FinishUnshard() {
  if (!UnshardNeeded() || unsharded_) return;
  if (full_kept_ && !has_pending_unshard()) {
    PointParamsAtFull();
    full_kept_ = false;
    unsharded_ = true;
    return;
  }
  if (!uses_sharded_views()) {
    at::NoGradGuard no_grad;
    AllocateStorage(full_);
    full_.copy_(local_shard_, /*non_blocking=*/true);  // The host is not read before the stream.
    PointParamsAtFull();
    unsharded_ = true;
    return;
  }
  TORCH_CHECK(has_pending_unshard(), Describe(),
              ": FinishUnshard without a pending all-gather (call StartUnshard first); "
              "training state ", HandleTrainingStateName(training_state_));
  WaitForPendingUnshard();
  if (summon_full_.defined()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].param.set_data(FullViewOf(summon_full_, i));
    }
  } else {
    PointParamsAtFull();
  }
  unsharded_ = true;
}

void FlatParamHandle::Unshard() {
  StartUnshard();
  FinishUnshard();
}

void FlatParamHandle::WaitForPendingUnshard() {
  try {
    WaitAll(std::move(pending_unshard_));
  } catch (...) {
    // A failed all-gather leaves the handle sharded with nothing allocated,
    // as before it started.
    pending_unshard_.clear();
    send_buffer_ = at::Tensor();
    post_forward_shard_ = at::Tensor();
    shard_snapshot_ = at::Tensor();
    FreeStorage(full_);
    summon_full_ = at::Tensor();
    throw;
  }
  pending_unshard_.clear();
  send_buffer_ = at::Tensor();
  post_forward_shard_ = at::Tensor();
  shard_snapshot_ = at::Tensor();
}

void FlatParamHandle::WaitForUnshard() {
  if (!has_pending_unshard()) return;
  TORCH_CHECK(!summon_full_.defined(), Describe(),
              ": WaitForUnshard of a full-precision all-gather (kSummonFullParams)");
  WaitForPendingUnshard();
  full_kept_ = true;
}

void FlatParamHandle::ReshardKeepingFull() {
  TORCH_CHECK(unsharded_ && !summon_full_.defined() && full_.defined(), Describe(),
              ": ReshardKeepingFull needs the unit unsharded for compute; training state ",
              HandleTrainingStateName(training_state_));
  unsharded_ = false;  // Reshard then leaves full_ alone.
  Reshard();
  full_kept_ = true;
}

void FlatParamHandle::DiscardPendingUnshard() {
  if (!has_pending_unshard()) return;
  WaitForPendingUnshard();
  if (!unsharded_) {
    FreeStorage(full_);
    summon_full_ = at::Tensor();
  }
}

void FlatParamHandle::ReshardAfterForward() {
  Collectives* post = options_.post_forward_group;
  if (post == nullptr || !uses_sharded_views() || !unsharded_ || summon_full_.defined()) {
    Reshard();
    return;
  }
  at::Tensor pieces;
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> mine;
    for (const Segment& seg : segments_) {
      const int64_t piece = seg.padded_numel / post->world_size();
      mine.push_back(full_.narrow(0, seg.full_begin + post->rank() * piece, piece));
    }
    pieces = mine.size() == 1 ? mine.front().clone() : at::cat(mine);
  }
  Reshard();
  post_forward_shard_ = std::move(pieces);
}

void FlatParamHandle::Reshard() {
  if (uses_sharded_views() || low_precision_ || options_.offload_params) {
    TORCH_CHECK(!has_pending_unshard(), Describe(),
                ": Reshard while an all-gather is pending (call FinishUnshard first)");
    post_forward_shard_ = at::Tensor();
    if (full_kept_) {
      FreeStorage(full_);
      full_kept_ = false;
    }
    if (unsharded_) {
      if (summon_full_.defined()) {
        summon_full_ = at::Tensor();
      } else {
        FreeStorage(full_);
      }
      unsharded_ = false;
    }
  }
  PointParamsAtShard();
  if (gradients_pending_) PublishGradients();
}

void FlatParamHandle::PrepareGradientsForBackward() {
  TORCH_CHECK(unsharded_ || !UnshardNeeded(), Describe(),
              ": PrepareGradientsForBackward needs the unit unsharded; training state ",
              HandleTrainingStateName(training_state_));
  TORCH_CHECK(!has_pending_reduction(), Describe(),
              ": PrepareGradientsForBackward while the last reduction is pending");
  // Reduced but not yet published (two backward passes without a Reshard
  // between): the accumulated gradient is in sharded_grad_ already. Or
  // no_sync: .grad holds full gradients that this backward adds to.
  if (gradients_pending_ || holds_unreduced_) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!infos_[i].trainable) continue;
    const at::Tensor grad = params_[i].param.grad();
    if (!grad.defined() && !sharded_grad_.defined()) continue;  // Nothing yet.
    if (!sharded_grad_.defined()) AllocateShardedGrad(at::Tensor());
    const at::Tensor& alias = grad_aliases_[i];
    if (!grad.defined()) {
      alias.zero_();  // Cleared by the user: accumulation restarts at zero.
    } else if (!grad.is_alias_of(alias) || grad.sizes() != alias.sizes()) {
      TORCH_CHECK(grad.numel() == alias.numel(), Describe(), ": the gradient of '",
                  infos_[i].fqn, "' has ", grad.numel(), " elements but this rank owns ",
                  alias.numel(), " of the parameter");
      alias.copy_(grad.reshape(alias.sizes()));  // Replaced by the user.
    }
    params_[i].param.mutable_grad() = at::Tensor();
  }
}

void FlatParamHandle::StartReduceGradients(bool all_reduce) {
  TORCH_CHECK(unsharded_ || !UnshardNeeded(), Describe(),
              ": ReduceGradients needs the unit unsharded; training state ",
              HandleTrainingStateName(training_state_));
  TORCH_CHECK(has_trainable_params(), Describe(),
              ": ReduceGradients on a unit without trainable parameters");
  TORCH_CHECK(!has_pending_reduction(), Describe(),
              ": ReduceGradients while the previous reduction is pending");
  at::NoGradGuard no_grad;
  // Copying the gradients in casts them to the reduction's dtype. Only the
  // trainable segment is reduced: it starts the flat parameter.
  const Segment& trainable = segments_.front();
  const at::ScalarType reduce_dtype = options_.reduce_dtype.value_or(compute_dtype_);
  at::Tensor flat_grad =
      at::zeros({trainable.padded_numel},
                local_shard_.options().dtype(reduce_dtype).device(compute_device_));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!infos_[i].trainable) continue;
    const at::Tensor grad = params_[i].param.grad();
    if (!grad.defined()) continue;  // Unused in this backward: contributes zero.
    TORCH_CHECK(grad.sizes().vec() == infos_[i].shape, Describe(), ": the gradient of '",
                infos_[i].fqn, "' has shape ", grad.sizes(), " but the parameter has shape ",
                at::IntArrayRef(infos_[i].shape),
                " (was PrepareGradientsForBackward called before backward?)");
    flat_grad.narrow(0, infos_[i].offset, infos_[i].numel).copy_(grad.reshape({-1}));
    RecordUseOnCurrentStream(grad);  // Made on compute, read here (the reduction's stream).
    params_[i].param.mutable_grad() = at::Tensor();
  }
  at::Tensor reduced = uses_sharded_views()
                           ? at::empty({trainable.shard_numel}, flat_grad.options())
                           : flat_grad;  // NO_SHARD reduces in place.
  CommHookContext context{group_, uses_sharded_views(), unit_name_, options_.replicate_group,
                          divide_factor_};
  const bool hybrid =
      options_.replicate_group != nullptr && options_.replicate_group->world_size() > 1;
  context.all_reduce = all_reduce || !hybrid;
  if (context.all_reduce && partial_reduced_.defined()) {
    context.add_before_all_reduce = std::move(partial_reduced_);
    partial_reduced_ = at::Tensor();
  }
  std::unique_ptr<PendingReduction> pending =
      comm_hook_ != nullptr ? comm_hook_->Reduce(context, std::move(flat_grad), reduced)
                            : DefaultCommHook().Reduce(context, std::move(flat_grad), reduced);
  TORCH_CHECK(pending != nullptr, Describe(), ": the comm hook '",
              comm_hook_ != nullptr ? comm_hook_->Name() : "default",
              "' returned no reduction (a synchronous hook returns CompletedReduction())");
  pending_reduction_ = std::move(pending);
  reduced_ = std::move(reduced);
  reduction_is_partial_ = !context.all_reduce;
  holds_unreduced_ = false;
}

void FlatParamHandle::AdvanceReduction() {
  if (!has_pending_reduction()) return;
  try {
    pending_reduction_->Advance();
  } catch (...) {
    pending_reduction_.reset();
    reduced_ = at::Tensor();
    throw;
  }
}

void FlatParamHandle::FinishReduceGradients() {
  if (!has_pending_reduction()) return;
  std::unique_ptr<PendingReduction> pending = std::move(pending_reduction_);
  at::Tensor reduced = std::move(reduced_);
  pending->Wait();
  pending.reset();
  at::NoGradGuard no_grad;
  const bool params_at_shard =
      uses_sharded_views() ? !unsharded_ : !options_.offload_params || !unsharded_;
  if (reduction_is_partial_) {
    // Kept in the reduction's dtype on the compute device until the
    // all-reduce that takes it; the sharded gradient (and .grad) stay as
    // they were.
    partial_reduced_ = partial_reduced_.defined() ? partial_reduced_.add_(reduced) : reduced;
    if (sharded_grad_.defined()) {
      gradients_pending_ = true;
      if (params_at_shard) PublishGradients();
    }
    return;
  }
  if (reduced.scalar_type() != GradDtype()) reduced = reduced.to(GradDtype());
  if (options_.offload_params) {
    // Accumulated on the compute device, in stream order: nothing here
    // waits for the device (see "CPU offload" in the header).
    if (sharded_grad_.defined()) {
      reduced.add_(OnComputeDevice(sharded_grad_, sharded_grad_.scalar_type()));
    } else {
      AllocateShardedGrad(EmptyOnHost(reduced.numel(), reduced.scalar_type()));
    }
    sharded_grad_.copy_(reduced, /*non_blocking=*/true);
  } else if (sharded_grad_.defined()) {
    sharded_grad_.add_(reduced);
  } else {
    AllocateShardedGrad(std::move(reduced));
  }
  gradients_pending_ = true;
  // The parameters view the shard already: NO_SHARD (unless offloading,
  // where they are on the compute device until Reshard points them at the
  // host), or a unit resharded while its reduction was in flight.
  if (params_at_shard) PublishGradients();
}

void FlatParamHandle::ReduceGradients() {
  StartReduceGradients();
  FinishReduceGradients();
}

void FlatParamHandle::WritebackShard() {
  if (!uses_sharded_views()) return;  // The parameters view the shard itself.
  TORCH_CHECK(unsharded_, Describe(), ": WritebackShard needs the unit unsharded");
  at::NoGradGuard no_grad;
  const at::Tensor& full = summon_full_.defined() ? summon_full_ : full_;
  for (const Segment& seg : segments_) {
    local_shard_.narrow(0, seg.shard_begin, seg.shard_numel)
        .copy_(full.narrow(0, seg.full_begin + group_.rank() * seg.shard_numel, seg.shard_numel));
  }
}

void FlatParamHandle::UnshardGradients() {
  if (!uses_sharded_views() || !sharded_grad_.defined() || !has_trainable_params()) return;
  TORCH_CHECK(!holds_unreduced_ && !gradients_pending_ && !has_pending_reduction(), Describe(),
              ": gradients are not reduced yet (inside no_sync or backward)");
  full_grad_ = AllGatherShardLike(
      options_.offload_params ? OnComputeDevice(sharded_grad_, sharded_grad_.scalar_type())
                              : sharded_grad_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (infos_[i].trainable) params_[i].param.mutable_grad() = FullViewOf(full_grad_, i);
  }
}

void FlatParamHandle::ReshardGradients(bool writeback) {
  if (!full_grad_.defined()) return;
  if (writeback) {
    at::NoGradGuard no_grad;
    sharded_grad_.copy_(full_grad_.narrow(0, group_.rank() * sharded_grad_.numel(),
                                          sharded_grad_.numel()));
  }
  full_grad_ = at::Tensor();
  PublishGradients();
}

void FlatParamHandle::KeepGradientsUnreduced() {
  TORCH_CHECK(!gradients_pending_ && !has_pending_reduction(), Describe(),
              ": KeepGradientsUnreduced after ReduceGradients in the same backward");
  holds_unreduced_ = true;
}

}  // namespace fsdp
