"""Memory watch: catch the slow climb that wedged the VM, on the host and on the GPUs.

- :mod:`gce_watchdog.memory.detector`: the pure climb detector (no clock, no I/O).
- :mod:`gce_watchdog.memory.samplers`: host memory through psutil, GPU memory through NVML.
- :mod:`gce_watchdog.memory.monitor`: the in-agent monitor (own thread, serial lines).
- :mod:`gce_watchdog.memory.memwatch`: ``memwatch``'s library: sample a process tree, judge it.
- :mod:`gce_watchdog.memory.cli`: ``gce-watchdog memwatch`` (options only).

``docs/memory-watch.md`` explains the method and the JSON output.
"""

GIB = 1 << 30
MIB = 1 << 20
