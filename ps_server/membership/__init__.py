"""Ranks as a shard sees them (leases, incarnations, clocks) and the cluster's membership epochs."""
