// Internal to the DCP files of formats/: the reader of .metadata's pickle
// (formats/dcp_metadata_reader.cc). ReadDcpMetadata runs it on what it
// reads, and CommitDcpMetadata (formats/dcp_writer.cc) on what it is about
// to write, so that a checkpoint is never committed that would not read back.
#ifndef FSDP_FORMATS_DCP_INTERNAL_H_
#define FSDP_FORMATS_DCP_INTERNAL_H_

#include <string>

#include "absl/status/statusor.h"
#include "formats/dcp.h"
#include "formats/restricted_unpickler.h"

namespace fsdp::dcp_internal {

// `bytes`, a .metadata pickle, unpickled against the allow-list of the
// globals DCP's metadata names; a pickle naming any other global is refused,
// naming it. `what` says what the bytes are in errors.
absl::StatusOr<PyRef> UnpickleDcpMetadata(const std::string& bytes, const std::string& what);

// The metadata `root` (UnpickleDcpMetadata's) holds, checked as dcp.h says.
// Errors read "DCP checkpoint '<dir>': ...".
absl::StatusOr<DcpMetadata> ParseDcpMetadata(const std::string& dir, const PyRef& root);

}  // namespace fsdp::dcp_internal

#endif  // FSDP_FORMATS_DCP_INTERNAL_H_
