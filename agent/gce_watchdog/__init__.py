"""gce-watchdog: VM-side watchdog agent and bootstrap toolkit for GCE."""

__version__ = "0.1.0"
