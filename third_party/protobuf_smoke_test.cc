#include <string>

#include "gtest/gtest.h"
#include "third_party/protobuf_smoke.pb.h"

namespace {

TEST(ProtobufSmoke, RoundTripsThroughWireFormat) {
  fsdp::third_party::TensorRecord record;
  record.set_fqn("transformer.h.0.attn.c_attn.weight");
  record.add_global_shape(768);
  record.add_global_shape(2304);
  fsdp::third_party::ShardRecord* shard = record.add_shards();
  shard->set_rank(3);
  shard->set_offset(int64_t{1} << 40);
  shard->set_length(442368);
  shard->set_crc32c(0xdeadbeef);

  std::string wire;
  ASSERT_TRUE(record.SerializeToString(&wire));
  fsdp::third_party::TensorRecord parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(parsed.fqn(), record.fqn());
  ASSERT_EQ(parsed.global_shape_size(), 2);
  EXPECT_EQ(parsed.global_shape(1), 2304);
  ASSERT_EQ(parsed.shards_size(), 1);
  EXPECT_EQ(parsed.shards(0).offset(), int64_t{1} << 40);
  EXPECT_EQ(parsed.shards(0).crc32c(), 0xdeadbeefu);

  // A truncated message must not parse as the original.
  fsdp::third_party::TensorRecord truncated;
  EXPECT_FALSE(truncated.ParseFromString(wire.substr(0, wire.size() - 3)) &&
               truncated.shards_size() == 1 &&
               truncated.shards(0).crc32c() == 0xdeadbeefu);
}

}  // namespace
