"""The pure core shared by shards and workers: plan, codecs, errors, optimizer specs (no grpc)."""
