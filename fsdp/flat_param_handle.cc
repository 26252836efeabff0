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
#include "c10/util/Exception.h"
#include "comm/block_quantization.h"
#include "fsdp/quantized_gather.h"

namespace fsdp {
namespace {

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

FlatLayout LayOut(const std::vector<FlatParamEntry>& params, const ResolvedUnitOptions& options,
                  const Collectives& group) {
  std::vector<FlatLayout::Param> specs;
  for (const FlatParamEntry& p : params) {
    specs.push_back({p.fqn, p.param.sizes().vec(), p.param.requires_grad()});
  }
  return FlatLayout::Of(specs, options.strategy != ShardingStrategy::kNoShard, group.world_size(),
                        group.rank());
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
    const ResolvedUnitOptions& options) {
  FSDP_RETURN_IF_ERROR(CheckParams(unit_name, params, group));
  FSDP_RETURN_IF_ERROR(CheckAllGatherQuantization(
      unit_name, options.strategy, options.mixed_precision, options.all_gather_quantization,
      params.front().param.scalar_type(), params.front().fqn));
  FSDP_RETURN_IF_ERROR(CheckReduceQuantization(
      unit_name, options.strategy, options.mixed_precision, options.reduce_quantization,
      params.front().param.scalar_type(), params.front().fqn));
  if ((options.all_gather_quantization == CommQuantization::kInt8 ||
       options.reduce_quantization == CommQuantization::kInt8) &&
      !CanQuantizeOn(params.front().param.device())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unit '", unit_name, "' has int8 all-gather or reduce quantization on ",
        params.front().param.device().str(),
        ", for which this program has no block-quantization kernels (a CUDA build links "
        "//comm:block_quantization_cuda)"));
  }
  if (IsHybrid(options.strategy) && options.replicate == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit '", unit_name, "': ", ShardingStrategyName(options.strategy),
        " needs a replicate group (ProcessGroups::replicate) besides the shard group"));
  }
  return std::unique_ptr<FlatParamHandle>(
      new FlatParamHandle(std::move(unit_name), std::move(params), group, options));
}

FlatParamHandle::FlatParamHandle(std::string unit_name, std::vector<FlatParamEntry> params,
                                 Collectives& group, const ResolvedUnitOptions& options)
    : unit_name_(std::move(unit_name)),
      params_(std::move(params)),
      group_(group),
      options_(options),
      placement_{params_.front().param.device(), options.offload_params},
      layout_(LayOut(params_, options, group)) {
  // This rank's part of the current values (identical on every rank: the
  // caller's contract), copied straight from the parameters: the flat
  // parameter is never built whole, so wrapping costs at most one unit's
  // parameters above the shards (a deferred unit's, just materialized).
  const at::TensorOptions tensor_options = params_.front().param.options().requires_grad(false);
  int64_t shard_numel = 0;
  for (const FlatLayout::Segment& seg : layout_.segments()) shard_numel += seg.shard_numel;
  local_shard_ = options_.offload_params
                     ? placement_.EmptyOnHost(shard_numel, params_.front().param.scalar_type())
                     : at::empty({shard_numel}, tensor_options);
  {
    at::NoGradGuard no_grad;
    local_shard_.zero_();  // The padding.
    for (size_t i = 0; i < params_.size(); ++i) {
      const FlatParamInfo& info = layout_.params()[i];
      const at::Tensor value = params_[i].param.detach();
      if (!layout_.sharded()) {
        layout_.ShardViewOf(local_shard_, i).copy_(value);
      } else if (info.shard_numel > 0) {
        layout_.ShardViewOf(local_shard_, i)
            .copy_(value.reshape({-1}).narrow(0, info.shard_offset, info.shard_numel));
      }
    }
  }
  // The views parameters swap between are made once: building a view costs
  // about as much as the swap itself, and views of full_ stay valid while
  // its storage is freed and reallocated.
  for (size_t i = 0; i < params_.size(); ++i) {
    shard_views_.push_back(layout_.ShardViewOf(local_shard_, i));
  }
  compute_dtype_ = options_.mixed_precision.param_dtype.value_or(local_shard_.scalar_type());
  low_precision_ = compute_dtype_ != local_shard_.scalar_type();
  if (layout_.sharded() || low_precision_ || options_.offload_params) {
    // Never written before it is freed: its pages are never touched.
    full_ = at::empty({layout_.padded_numel()}, tensor_options.dtype(compute_dtype_));
    for (const FlatParamInfo& info : layout_.params()) {  // Views need the storage allocated.
      full_views_.push_back(full_.narrow(0, info.offset, info.numel).view(info.shape));
    }
    FreeStorage(full_);
  }
  if (layout_.sharded() && options_.all_gather_quantization != CommQuantization::kNone) {
    quantized_ = std::make_unique<QuantizedGather>(
        layout_, group_.world_size(), options_.all_gather_quantization, placement_.compute_device);
  }
  PointParamsAtShard();
  GradientReductionOptions reduction;
  reduction.replicate = options_.replicate;
  reduction.reduce_dtype = options_.reduce_dtype().value_or(compute_dtype_);
  reduction.grad_dtype = options_.mixed_precision.keep_low_precision_grads
                             ? reduction.reduce_dtype
                             : local_shard_.scalar_type();
  reduction.divide_factor = options_.gradient_divide_factor;
  if (layout_.sharded() && layout_.has_trainable_params() &&
      options_.reduce_quantization != CommQuantization::kNone) {
    quantized_reduce_ = std::make_unique<QuantizedReduceScatter>(
        layout_, group_.world_size(), options_.reduce_quantization, placement_.compute_device);
    reduction.sum_scatter = [this](const at::Tensor& flat_grad, const at::Tensor& out) {
      return quantized_reduce_->Start(flat_grad, out, group_);
    };
    if (Collectives* replicate = options_.replicate;
        replicate != nullptr && replicate->world_size() > 1) {
      quantized_replicate_sum_ = std::make_unique<QuantizedAllReduce>(
          layout_, replicate->world_size(), replicate->rank(), options_.reduce_quantization,
          placement_.compute_device);
      reduction.replicate_sum = [this, replicate](const at::Tensor& chunk) {
        return quantized_replicate_sum_->Start(chunk, *replicate);
      };
    }
  }
  reduction_ = std::make_unique<GradientReduction>(unit_name_, Describe(), layout_, group_,
                                                   placement_, reduction);
}

FlatParamHandle::~FlatParamHandle() = default;

std::vector<std::unique_ptr<CollectiveWork>> FlatParamHandle::AllGatherSegments(
    const at::Tensor& full, const at::Tensor& shard, size_t count) const {
  std::vector<std::unique_ptr<CollectiveWork>> works;
  try {
    for (size_t s = 0; s < count; ++s) {
      const FlatLayout::Segment& seg = layout_.segments()[s];
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

at::Tensor FlatParamHandle::AllGatherShardLike(const at::Tensor& flat) const {
  const int64_t trainable_numel = layout_.trainable_shard_numel();
  const bool trainable_only = flat.numel() == trainable_numel && layout_.has_trainable_params();
  TORCH_CHECK(flat.dim() == 1 && (trainable_only || flat.numel() == layout_.shard_numel()),
              Describe(), ": AllGatherShardLike takes ", trainable_numel, " or ",
              layout_.shard_numel(), " elements, not ", flat.numel());
  if (!layout_.sharded()) return flat;
  const size_t count = trainable_only ? 1 : layout_.segments().size();
  const FlatLayout::Segment& last = layout_.segments()[count - 1];
  at::Tensor full = at::empty({last.full_begin + last.padded_numel}, flat.options());
  WaitAll(AllGatherSegments(full, flat, count));
  return full;
}

std::string FlatParamHandle::Describe() const {
  return absl::StrCat("unit '", unit_name_, "' on rank ", group_.rank(), " of ",
                      group_.world_size());
}

bool FlatParamHandle::KeptFullMatchesShard() const {
  if (!holds_kept_full()) return true;
  at::NoGradGuard no_grad;
  // What the all-gather made of this rank's shard.
  const at::Tensor shard =
      quantized_ != nullptr ? quantized_->RoundTrip(placement_.OnComputeDevice(
                                                        local_shard_, local_shard_.scalar_type()),
                                                    compute_dtype_)
                            : placement_.OnComputeDevice(local_shard_, compute_dtype_);
  if (!layout_.sharded()) return at::equal(full_, shard);
  for (const FlatLayout::Segment& seg : layout_.segments()) {
    const at::Tensor mine =
        full_.narrow(0, layout_.OwnedBegin(seg, layout_.rank()), seg.shard_numel);
    if (!at::equal(mine, shard.narrow(0, seg.shard_begin, seg.shard_numel))) return false;
  }
  return true;
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

void FlatParamHandle::PointParamsAtShard() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].param.set_data(shard_views_[i]);
}

void FlatParamHandle::PublishGradients() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.params()[i].trainable) {
      params_[i].param.mutable_grad() = reduction_->grad_aliases()[i];
    }
  }
  if (grad_state_ == GradState::kToPublish) grad_state_ = GradState::kSettled;
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
  return layout_.sharded() || ((low_precision_ || options_.offload_params) &&
                               training_state_ != HandleTrainingState::kSummonFullParams);
}

int64_t FlatParamHandle::ShardBytesOn(c10::DeviceType type) const {
  int64_t bytes = 0;
  for (const at::Tensor* t : {&local_shard_, &reduction_->sharded_grad()}) {
    if (t->defined() && t->device().type() == type) {
      bytes += static_cast<int64_t>(t->storage().nbytes());
    }
  }
  return bytes;
}

void FlatParamHandle::SnapshotShard() {
  at::NoGradGuard no_grad;
  shard_snapshot_ = local_shard_.clone();
}

void FlatParamHandle::StartUnshard() {
  // NO_SHARD's low-precision copy is a local cast, made in FinishUnshard.
  if (!layout_.sharded() || full_state_ != FullParamState::kSharded || has_pending_unshard()) {
    return;
  }
  const bool copies = low_precision_ || options_.offload_params;
  const at::Tensor& shard = shard_snapshot_.defined() ? shard_snapshot_ : local_shard_;
  const size_t segments = layout_.segments().size();
  try {
    if (low_precision_ && training_state_ == HandleTrainingState::kSummonFullParams) {
      summon_full_ = at::empty({layout_.padded_numel()},
                               local_shard_.options().device(placement_.compute_device));
      if (options_.offload_params) {
        send_buffer_ = placement_.OnComputeDevice(local_shard_, local_shard_.scalar_type());
      }
      pending_unshard_ = AllGatherSegments(
          summon_full_, options_.offload_params ? send_buffer_ : local_shard_, segments);
      return;
    }
    AllocateStorage(full_);
    if (post_forward_shard_.defined() &&
        training_state_ != HandleTrainingState::kSummonFullParams) {
      // Made on the compute stream, read by this all-gather, dropped after it.
      RecordUseOnCurrentStream(post_forward_shard_);
      Collectives& post = *options_.post_forward;
      int64_t begin = 0;
      for (const FlatLayout::Segment& seg : layout_.segments()) {
        const int64_t piece = seg.padded_numel / post.world_size();
        pending_unshard_.push_back(
            post.AllGatherIntoTensor(full_.narrow(0, seg.full_begin, seg.padded_numel),
                                     post_forward_shard_.narrow(0, begin, piece)));
        begin += piece;
      }
      return;
    }
    RecordUseOnCurrentStream(shard_snapshot_);  // Made on compute, read here.
    if (quantized_ != nullptr && training_state_ != HandleTrainingState::kSummonFullParams) {
      // Coded from the full-precision shard, decoded into the compute dtype.
      if (options_.offload_params) {
        send_buffer_ = placement_.OnComputeDevice(shard, shard.scalar_type());
      }
      pending_unshard_.push_back(
          quantized_->Start(options_.offload_params ? send_buffer_ : shard, group_));
      return;
    }
    if (copies) send_buffer_ = placement_.OnComputeDevice(shard, compute_dtype_);
    pending_unshard_ = AllGatherSegments(full_, copies ? send_buffer_ : shard, segments);
  } catch (...) {
    // Nothing issued is still running (AllGatherSegments waited; the
    // post-forward all-gathers are waited for here): sharded with nothing
    // allocated, as before, and the next unshard gathers the shards.
    try {
      WaitAll(std::move(pending_unshard_));
    } catch (...) {
    }
    pending_unshard_.clear();
    if (quantized_ != nullptr) quantized_->Discard();
    post_forward_shard_ = at::Tensor();
    shard_snapshot_ = at::Tensor();
    send_buffer_ = at::Tensor();
    summon_full_ = at::Tensor();
    FreeStorage(full_);
    throw;
  }
}

void FlatParamHandle::FinishUnshard() {
  if (!UnshardNeeded() || is_unsharded()) return;
  if (holds_kept_full() && !has_pending_unshard()) {
    PointParamsAtFull();
    full_state_ = FullParamState::kUnsharded;
    return;
  }
  if (!layout_.sharded()) {
    at::NoGradGuard no_grad;
    AllocateStorage(full_);
    full_.copy_(local_shard_, /*non_blocking=*/true);  // The host is not read before the stream.
    PointParamsAtFull();
    full_state_ = FullParamState::kUnsharded;
    return;
  }
  TORCH_CHECK(has_pending_unshard(), Describe(),
              ": FinishUnshard without a pending all-gather (call StartUnshard first); "
              "training state ", HandleTrainingStateName(training_state_));
  WaitForPendingUnshard();
  if (summon_full_.defined()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].param.set_data(layout_.FullViewOf(summon_full_, i));
    }
  } else {
    PointParamsAtFull();
  }
  full_state_ = FullParamState::kUnsharded;
}

void FlatParamHandle::Unshard() {
  StartUnshard();
  FinishUnshard();
}

void FlatParamHandle::WaitForPendingUnshard(bool decode) {
  try {
    WaitAll(std::move(pending_unshard_));
    if (quantized_ != nullptr && quantized_->pending()) {
      if (decode) {
        quantized_->Finish(full_);
      } else {
        quantized_->Discard();
      }
    }
  } catch (...) {
    if (quantized_ != nullptr) quantized_->Discard();
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
  full_state_ = FullParamState::kShardedKeepingFull;
}

void FlatParamHandle::ReshardKeepingFull() {
  TORCH_CHECK(is_unsharded() && !summon_full_.defined() && full_.defined(), Describe(),
              ": ReshardKeepingFull needs the unit unsharded for compute; training state ",
              HandleTrainingStateName(training_state_));
  full_state_ = FullParamState::kSharded;  // Reshard then leaves full_ alone.
  Reshard();
  full_state_ = FullParamState::kShardedKeepingFull;
}

void FlatParamHandle::DiscardPendingUnshard() {
  if (!has_pending_unshard()) return;
  WaitForPendingUnshard(/*decode=*/false);
  if (!is_unsharded()) {
    FreeStorage(full_);
    summon_full_ = at::Tensor();
  }
}

void FlatParamHandle::ReshardAfterForward() {
  Collectives* post = options_.post_forward;
  if (post == nullptr || !layout_.sharded() || !is_unsharded() || summon_full_.defined()) {
    Reshard();
    return;
  }
  at::Tensor pieces;
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> mine;
    for (const FlatLayout::Segment& seg : layout_.segments()) {
      const int64_t piece = seg.padded_numel / post->world_size();
      mine.push_back(full_.narrow(0, seg.full_begin + post->rank() * piece, piece));
    }
    pieces = mine.size() == 1 ? mine.front().clone() : at::cat(mine);
  }
  Reshard();
  post_forward_shard_ = std::move(pieces);
}

void FlatParamHandle::Reshard() {
  if (layout_.sharded() || low_precision_ || options_.offload_params) {
    TORCH_CHECK(!has_pending_unshard(), Describe(),
                ": Reshard while an all-gather is pending (call FinishUnshard first)");
    post_forward_shard_ = at::Tensor();
    if (holds_kept_full()) {
      FreeStorage(full_);
    } else if (is_unsharded()) {
      if (summon_full_.defined()) {
        summon_full_ = at::Tensor();
      } else {
        FreeStorage(full_);
      }
    }
    full_state_ = FullParamState::kSharded;
  }
  PointParamsAtShard();
  if (grad_state_ == GradState::kToPublish) PublishGradients();
}

void FlatParamHandle::PrepareGradientsForBackward() {
  TORCH_CHECK(is_unsharded() || !UnshardNeeded(), Describe(),
              ": PrepareGradientsForBackward needs the unit unsharded; training state ",
              HandleTrainingStateName(training_state_));
  TORCH_CHECK(!has_pending_reduction(), Describe(),
              ": PrepareGradientsForBackward while the last reduction is pending");
  // Reduced but not yet published (two backward passes without a Reshard
  // between): the accumulated gradient is in the sharded gradient already.
  // Or no_sync: .grad holds full gradients that this backward adds to.
  if (grad_state_ != GradState::kSettled) return;
  reduction_->SetAsideAccumulated(params_);
}

void FlatParamHandle::StartReduceGradients(bool all_reduce) {
  TORCH_CHECK(is_unsharded() || !UnshardNeeded(), Describe(),
              ": ReduceGradients needs the unit unsharded; training state ",
              HandleTrainingStateName(training_state_));
  reduction_->Start(params_, all_reduce);
  // Reduced gradients still waiting for a Reshard (two backward passes
  // without one between) stay so: the next reduction adds to them.
  if (grad_state_ == GradState::kUnreduced) grad_state_ = GradState::kSettled;
}

void FlatParamHandle::FinishReduceGradients() {
  if (!reduction_->Finish()) return;
  grad_state_ = GradState::kToPublish;
  // The parameters view the shard already: NO_SHARD (unless offloading,
  // where they are on the compute device until Reshard points them at the
  // host), or a unit resharded while its reduction was in flight.
  const bool params_at_shard =
      layout_.sharded() ? !is_unsharded() : !options_.offload_params || !is_unsharded();
  if (params_at_shard) PublishGradients();
}

void FlatParamHandle::ReduceGradients() {
  StartReduceGradients();
  FinishReduceGradients();
}

void FlatParamHandle::WritebackShard() {
  if (!layout_.sharded()) return;  // The parameters view the shard itself.
  TORCH_CHECK(is_unsharded(), Describe(), ": WritebackShard needs the unit unsharded");
  at::NoGradGuard no_grad;
  const at::Tensor& full = summon_full_.defined() ? summon_full_ : full_;
  for (const FlatLayout::Segment& seg : layout_.segments()) {
    local_shard_.narrow(0, seg.shard_begin, seg.shard_numel)
        .copy_(full.narrow(0, layout_.OwnedBegin(seg, layout_.rank()), seg.shard_numel));
  }
}

void FlatParamHandle::UnshardGradients() {
  const at::Tensor& sharded_grad = reduction_->sharded_grad();
  if (!layout_.sharded() || !sharded_grad.defined() || !layout_.has_trainable_params()) return;
  TORCH_CHECK(grad_state_ == GradState::kSettled && !has_pending_reduction(), Describe(),
              ": gradients are not reduced yet (inside no_sync or backward)");
  full_grad_ = AllGatherShardLike(
      options_.offload_params ? placement_.OnComputeDevice(sharded_grad, sharded_grad.scalar_type())
                              : sharded_grad);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (layout_.params()[i].trainable) {
      params_[i].param.mutable_grad() = layout_.FullViewOf(full_grad_, i);
    }
  }
}

void FlatParamHandle::ReshardGradients(bool writeback) {
  if (!full_grad_.defined()) return;
  if (writeback) {
    at::NoGradGuard no_grad;
    const at::Tensor& sharded_grad = reduction_->sharded_grad();
    sharded_grad.copy_(
        full_grad_.narrow(0, layout_.rank() * sharded_grad.numel(), sharded_grad.numel()));
  }
  full_grad_ = at::Tensor();
  PublishGradients();
}

void FlatParamHandle::KeepGradientsUnreduced() {
  TORCH_CHECK(grad_state_ != GradState::kToPublish && !has_pending_reduction(), Describe(),
              ": KeepGradientsUnreduced after ReduceGradients in the same backward");
  grad_state_ = GradState::kUnreduced;
}

}  // namespace fsdp
