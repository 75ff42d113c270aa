"""One shard's state behind one lock: the :class:`~ps_server.shard.shard.shard.Shard` facade and its parts."""
