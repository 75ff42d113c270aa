"""``ps-launch``: shards and workers as local processes on one machine, watched and summarized."""
