#include "fsdp/cross_rank_checks.h"

#include <algorithm>
#include <cstring>

#include "ATen/Functions.h"
#include "absl/strings/str_cat.h"
#include "base/fnv1a.h"
#include "c10/util/Exception.h"

namespace fsdp {

UnitSignature SignatureOf(const std::string& fqn, const ResolvedUnitOptions& options,
                          const FlatLayout* layout) {
  UnitSignature signature{.fqn = fqn,
                          .strategy = options.strategy,
                          .mixed_precision = options.mixed_precision,
                          .all_gather_quantization = options.all_gather_quantization,
                          .reduce_quantization = options.reduce_quantization};
  if (layout != nullptr) {
    signature.flat_numel = layout->flat_numel();
    for (const FlatParamInfo& info : layout->params()) {
      signature.trainable += info.trainable ? '1' : '0';
    }
  }
  return signature;
}

void CheckSameWrapOnEveryRank(const ProcessGroups& groups, const FsdpOptions& options,
                              const std::vector<UnitSignature>& units) {
  // One all-gather of a fingerprint per rank; the unit count and total size
  // travel beside it so that the error can say what differs.
  Collectives& group = *groups.shard;
  uint64_t hash = Fnv1aString(kFnv1aOffsetBasis, CrossRankOptionsKey(options, groups));
  int64_t elements = 0;
  for (const UnitSignature& unit : units) {
    elements += unit.flat_numel;
    hash = Fnv1aString(
        hash, absl::StrCat(unit.fqn, ":", unit.flat_numel, ":", unit.trainable, ":",
                           static_cast<int>(unit.strategy), ":", unit.mixed_precision.ToString(),
                           ":", CommQuantizationName(unit.all_gather_quantization), ":",
                           CommQuantizationName(unit.reduce_quantization), ";"));
  }
  const int world = group.world_size();
  CollectiveLabel label(group, "", "lazy init (wrap plan check)");
  // Doubles carry 52 bits exactly: the fingerprint's top ones.
  at::Tensor mine = at::tensor({static_cast<double>(units.size()), static_cast<double>(elements),
                                static_cast<double>(hash >> 12)},
                               at::kDouble);
  at::Tensor all = at::empty({world * 3}, at::kDouble);
  group.AllGatherIntoTensor(all, mine)->Wait();
  at::Tensor table = all.view({world, 3});
  if (at::equal(table, table[0].expand({world, 3}))) return;
  std::string ranks;
  for (int r = 0; r < world; ++r) {
    absl::StrAppend(&ranks, r == 0 ? "" : "; ", "rank ", r, ": ",
                    static_cast<int64_t>(table[r][0].item<double>()), " units, ",
                    static_cast<int64_t>(table[r][1].item<double>()),
                    " parameter elements, plan fingerprint ",
                    static_cast<int64_t>(table[r][2].item<double>()));
  }
  TORCH_CHECK(false, "rank ", group.rank(), " of ", world,
              ": ranks wrapped the model differently (units, their parameters, or FSDP "
              "options differ) — ", ranks,
              ". Every rank must wrap the same model with the same policy and options.");
}

void CheckPostForwardGroup(Collectives& shard_group, Collectives& post_forward_group) {
  const int k = post_forward_group.world_size();
  at::Tensor held = at::empty({k}, at::kDouble);
  {
    CollectiveLabel label(post_forward_group, "", "lazy init (post-forward group check)");
    post_forward_group
        .AllGatherIntoTensor(held, at::tensor({double(shard_group.rank())}, at::kDouble))
        ->Wait();
  }
  const int first = shard_group.rank() / k * k;
  std::string mine;
  bool consecutive = true;
  for (int j = 0; j < k; ++j) {
    const int rank = static_cast<int>(held[j].item<double>());
    absl::StrAppend(&mine, j == 0 ? "" : ", ", rank);
    consecutive = consecutive && rank == first + j;
  }
  // Only the ranks of a wrong group see it: the verdict is shared, so that
  // no rank goes on into a forward the others left.
  at::Tensor wrong = at::tensor({consecutive ? 0.0 : 1.0}, at::kDouble);
  {
    CollectiveLabel label(shard_group, "", "lazy init (post-forward group check)");
    shard_group.AllReduce(wrong, ReduceOp::kSum)->Wait();
  }
  const int wrong_ranks = static_cast<int>(wrong.item<double>());
  TORCH_CHECK(wrong_ranks == 0, "rank ", shard_group.rank(), " of ", shard_group.world_size(),
              ": ProcessGroups::post_forward is not each rank's block of ", k,
              " consecutive shard-group ranks on ", wrong_ranks,
              " rank(s); this rank's holds shard-group ranks {", mine,
              "} in its rank order, and should hold {", first, "..", first + k - 1,
              "} (HybridShardLayout(W, k)'s shard group)");
}

void CheckSameExecutionOrderOnEveryRank(Collectives& group, const std::vector<int>& order,
                                        const std::vector<std::string>& unit_names) {
  const int world = group.world_size();
  CollectiveLabel label(group, "", "execution order check");
  const std::string mine(reinterpret_cast<const char*>(order.data()), order.size() * sizeof(int));
  std::vector<std::vector<int>> orders;
  size_t longest = 0;
  for (const std::string& bytes : AllGatherBytes(group, mine)) {
    orders.emplace_back(bytes.size() / sizeof(int));
    std::memcpy(orders.back().data(), bytes.data(), orders.back().size() * sizeof(int));
    longest = std::max(longest, orders.back().size());
  }
  // The unit index rank r ran at `pos`; -1 once its forward was over.
  auto ran = [&orders](int r, size_t pos) { return pos < orders[r].size() ? orders[r][pos] : -1; };
  for (size_t pos = 0; pos < longest; ++pos) {
    bool same = true;
    for (int r = 1; r < world; ++r) same = same && ran(r, pos) == ran(0, pos);
    if (same) continue;
    std::string ranks;
    for (int r = 0; r < world; ++r) {
      const int index = ran(r, pos);
      absl::StrAppend(&ranks, r == 0 ? "" : ", ", "rank ", r, " ",
                      index < 0 ? std::string("had finished its forward")
                                : absl::StrCat("ran '", unit_names[index], "'"));
    }
    TORCH_CHECK(false, "rank ", group.rank(), " of ", world,
                ": FSDP units ran in different orders on different ranks in the first "
                "forward; at position ", pos + 1, " of the order in which units finished "
                "their forward, ", ranks, ". Every rank must run the same units in the "
                "same order.");
  }
}

}  // namespace fsdp
