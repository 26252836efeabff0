// A TCP port for a test's server, where the server cannot pick its own (a
// launcher of a job across hosts listens on the port every host was told).
#ifndef FSDP_TESTING_FREE_PORT_H_
#define FSDP_TESTING_FREE_PORT_H_

namespace fsdp::testing {

// A port nothing listens on now on any interface, as the kernel picks one; a
// test binds it soon after (another process could take it in between).
// Aborts the test binary when no socket can be made.
int FreeTcpPort();

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_FREE_PORT_H_
