// A FingerprintExchange over a c10d store: the TCPStore the ranks met
// through, which keeps working when the group's transport does not (a
// mismatched or timed-out collective, a dead peer).
//
// Keys: <prefix>/<round>/<rank>. Collect polls every few milliseconds up to
// its timeout, so that it can return the reports present when some never
// come (c10d's Store::wait fails as a whole). The store's host may end
// before a later rank's wait is over (it is done explaining, so it exits):
// Collect then returns the reports read by then. Every call gives up at a
// deadline (comm/store_deadline.h): Collect 2 s after its timeout, the
// others after 10 s; it then throws StoreUnreachable.
//
// This is an adapter file: c10d's types appear only in comm's adapters.
#ifndef FSDP_COMM_STORE_FINGERPRINT_EXCHANGE_H_
#define FSDP_COMM_STORE_FINGERPRINT_EXCHANGE_H_

#include <memory>
#include <string>

#include "comm/fingerprint.h"
#include "torch/csrc/distributed/c10d/Store.hpp"

namespace fsdp {

// REQUIRES: store non-null, 0 <= rank < world_size. Ranks of one group use
// the same store and prefix; groups sharing a store use distinct prefixes.
std::shared_ptr<FingerprintExchange> MakeStoreFingerprintExchange(
    c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world_size);

}  // namespace fsdp

#endif  // FSDP_COMM_STORE_FINGERPRINT_EXCHANGE_H_
