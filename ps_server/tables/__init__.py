"""Embedding tables of one shard: rows created on first update, row reads, row-wise optimizers."""
