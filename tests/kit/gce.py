"""One simulated Spot VM, the same in the fake metadata server and the fake Compute API."""

from __future__ import annotations

from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simgce import SimInstance

PROJECT = "sim-project"
ZONE = "us-central1-a"
NAME = "sim-vm-1"


def spot_vm_info() -> SimInstance:
    """The VM as its metadata server describes it."""
    return SimInstance(project=PROJECT, zone=ZONE, name=NAME)


def add_spot_vm(api: FakeComputeAPI) -> None:
    """The same VM in the Compute API: Spot, deleted when it is preempted."""
    api.add_instance(NAME, project=PROJECT, zone=ZONE, spot=True, termination_action="DELETE")
