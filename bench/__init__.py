"""Benchmarks: the agent against monit and watchdog(8) (``make bench``, docs/performance.md)."""
