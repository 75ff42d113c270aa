"""The shard's gRPC services: servicers that decode a request and make one shard call, and the
interceptors, credentials and bounded pools around them."""
