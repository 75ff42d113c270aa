"""Consistency policies (DESIGN section 5): pure code, no grpc, no sockets, no sleeping."""
