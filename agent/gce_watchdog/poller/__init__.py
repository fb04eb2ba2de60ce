"""The central poller: reads serial port 1 of many VMs, decides, and fails a job over exactly once.

Modules (kept separate so importing one does not pull in the others' dependencies):

- :mod:`gce_watchdog.poller.timeline`: decoded events per boot, sequence gaps, lost bytes, rejects.
- :mod:`poller.verdict`: the pure decision function :func:`~gce_watchdog.poller.verdict.decide`.
- :mod:`gce_watchdog.poller.reader`: the Compute API client and the incremental, resumable reader.
- :mod:`gce_watchdog.poller.ledger`: the SQLite ledger that makes a FAILOVER decision happen once.
- :mod:`gce_watchdog.testing.synth`: realistic serial dumps (real corpus + our lines + damage).
- :mod:`gce_watchdog.poller.cli`: ``gce-watchdog poll`` and ``gce-watchdog parse``.

``docs/poller.md`` documents the decision table, the reader and the ledger.
"""
