"""``ps-admin``: status, top, watch, set, evict and checkpoint calls against running shards.

Needs only grpcio and the generated messages: importing it leaves torch unloaded.
"""
