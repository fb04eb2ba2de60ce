"""The agent itself: the ladder (pure), probes, metadata watcher, the metadata trust rule
(mdtrust, pure), action chain, metrics, disarm."""
