"""The shard's gRPC services: servicers that decode a request and make one shard call, and the
one interceptor around them (its stages: metrics, credentials, bounded pools, decoding)."""
