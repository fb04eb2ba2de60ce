"""Small helpers with no policy of their own, usable by both sides (VM and central).

Atomic files, durations, HTTP dates, the subprocess runner, the retry policy, host:port parsing,
the DNS resolver and the Compute API client. Nothing here imports another part of the package
except ``wire`` (import-linter enforces it: docs/architecture.md).
"""
