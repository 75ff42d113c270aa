"""The worker's two transports (gRPC streams and data connections), their wire encoding and retries."""
