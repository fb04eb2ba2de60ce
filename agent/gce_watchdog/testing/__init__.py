"""A test kit, like structlog.testing: the fake GCE, the fake Compute API, dumps and the demo.

No product module imports this package (enforced by import-linter).
"""
