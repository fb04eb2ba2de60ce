"""The agent itself: the ladder (pure), probes, metadata watcher, action chain, metrics, disarm."""
