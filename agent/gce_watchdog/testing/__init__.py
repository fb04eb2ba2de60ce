"""A public test kit, like structlog.testing: the fake GCE (simgce), the fake Compute API
(simcompute), realistic serial dumps (synth) and the demo (docs/architecture.md, "The test kit").

It reads nothing outside the package: synth's corpus readers take the corpus's directory from the
caller. No product module imports this package (enforced by import-linter).
"""
