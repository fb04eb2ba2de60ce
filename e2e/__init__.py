"""End-to-end harness: a real Debian VM under qemu with a simulated GCE around it (docs/e2e.md)."""
