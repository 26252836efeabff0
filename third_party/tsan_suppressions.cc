// ThreadSanitizer suppressions for --config=tsan (.bazelrc), compiled into
// every test through :gtest_main (TSan reads them from this hook; a file
// named in TSAN_OPTIONS would have to be found from each test's sandbox).
// In builds without TSan nothing calls it.
//
// libtorch and Gloo from Debian are not instrumented: TSan cannot see the
// happens-before edges their reference counts and condition variables
// create, so it reports every c10d::Work handed between a caller and
// ProcessGroupGloo's worker threads (freed by the worker after the caller's
// wait, or its condition variable destroyed after notify_all) as a race.
// Triaged 2026-11-22: each of the 20 reports of //comm:fingerprint_test
// without these lines had libtorch_cpu's c10d or libgloo's UnboundBuffer on
// one side.
//
// The same holds for libstdc++'s exception_ptr: c10d hands a failed work's
// exception from a Gloo thread to the waiting one, and its reference count
// (atomics inside uninstrumented libstdc++) orders the last release after
// the reader's what(); TSan sees only the read and the delete. Likewise a
// tensor c10d's worker held for a collective: the worker's reference drop
// (inside libtorch) may be the last one, freeing storage that the caller
// read after its wait returned. That drop can also free the TensorImpl
// itself (inside libc10): seen 2026-11-22 in
// //comm:gloo_collectives_test's BroadcastAndAllGatherBytesDeliverBytesExactly,
// a Gloo worker's ~TensorImpl against the rank thread's earlier read in
// BroadcastBytes, in one CI run of several.
extern "C" const char* __tsan_default_suppressions() {
  return "race:libtorch_cpu.so\n"
         "race:libgloo.so\n"
         "race:std::__exception_ptr::exception_ptr::_M_release\n"
         "race:std::runtime_error::~runtime_error\n"
         "race:c10::StorageImpl::~StorageImpl\n"
         "race:c10::TensorImpl::~TensorImpl\n";
}
