"""The central poller: reads serial port 1 of many VMs, decides, and fails a job over exactly once.

Modules (kept separate so importing one does not pull in the others' dependencies):

- :mod:`agent.poller.timeline`: decoded events per boot, sequence gaps, lost bytes, rejects.
- :mod:`agent.poller.verdict`: the pure decision function :func:`~agent.poller.verdict.decide`.
- :mod:`agent.poller.reader`: the Compute API client and the incremental, resumable reader.
- :mod:`agent.poller.ledger`: the SQLite ledger that makes a FAILOVER decision happen once.
- :mod:`agent.poller.synth`: realistic serial dumps (real corpus + our lines + damage).
- :mod:`agent.poller.cli`: ``gce-watchdog poll`` and ``gce-watchdog parse``.

``docs/poller.md`` documents the decision table, the reader and the ledger.
"""
