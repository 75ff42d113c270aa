"""Checkpoints of one shard: the file format, atomic writes, the schedule, and model export."""
