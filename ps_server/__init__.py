"""grpc-ps shard: one process holding a set of parameter partitions and their optimizer."""
