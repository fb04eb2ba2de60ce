"""The central poller: reads serial port 1 of many VMs, decides, and fails a job over exactly once.

Modules (kept separate so importing one does not pull in the others' dependencies; ``cli``
imports the rest only inside its handlers):

- :mod:`gce_watchdog.poller.verdict`: the pure decision function
  :func:`~gce_watchdog.poller.verdict.decide` (events, instance state, now, policy in; verdict out).
- :mod:`gce_watchdog.poller.boots`: the pure boot order (the highest boot counter is current,
  a replayed or reused counter is ``boot_regressed``), one rule for every reader.
- :mod:`gce_watchdog.poller.timeline`: decoded events per boot, sequence gaps, lost bytes, rejects.
- :mod:`gce_watchdog.poller.assemble`: the pure reassembly of Pub/Sub lines (gap-free prefix).
- :mod:`gce_watchdog.poller.reader`: the incremental, resumable serial reader and its cursor store
  (through the one Compute API client, :mod:`gce_watchdog.lib.compute`).
- :mod:`gce_watchdog.poller.ledger`: the decisions store (``DecisionStore``) that makes a
  FAILOVER decision happen once; :mod:`gce_watchdog.poller.pin_store`: the readers' shared pins
  (``PinStore``); :mod:`gce_watchdog.poller.assembly_store`: the Pub/Sub workers' assembly state
  (``AssemblyStore``); :mod:`gce_watchdog.poller.freshness_store`: each boot's newest line and
  its first receipt, shared by every reader (``FreshnessStore``). Each is SQL over one
  connection of the ledger's database.
- :mod:`gce_watchdog.poller.ledger_db`: that connection and schema, SQLite;
  :mod:`gce_watchdog.poller.ledger_pg`: PostgreSQL, the same semantics across hosts.
- :mod:`gce_watchdog.poller.ledgers`: ``open_ledger``, the factory picking one of the two and
  handing out the stores (``Ledger``).
- :mod:`gce_watchdog.poller.identity`: who an instance id is (project, zone, name), asked of the
  Compute API, never taken from a LogEntry.
- :mod:`gce_watchdog.poller.poller`: one poll of one instance: read, decide, claim, reap.
- :mod:`gce_watchdog.poller.fleet`: a labelled fleet: discovery, the pool, the per-project budget.
- :mod:`gce_watchdog.poller.pubsub`: the event-driven worker (Cloud Logging lines via Pub/Sub).
- :mod:`gce_watchdog.poller.settings`: ``PollSettings``, ``poll``'s options checked once.
- :mod:`gce_watchdog.poller.app`: the composition root of ``poll``: client, ledger, cursors,
  budget, signals, then one loop per mode.
- :mod:`gce_watchdog.poller.decisions`: the ledger's versioned view for dispatchers, and
  ``gce-watchdog decisions`` (list, follow, held, release).
- :mod:`gce_watchdog.poller.hooks`: ``--on-failover`` (a command per announcement) and
  ``--publish`` (a Pub/Sub message per announcement).
- :mod:`gce_watchdog.poller.brake`: the fleet-wide brake's pure rule.
- :mod:`gce_watchdog.poller.cost`: what it cost, pure: a boot's billed, useful, ladder, linger,
  zombie and GPU seconds; a job's sum across boots and instances, as unions.
- :mod:`gce_watchdog.poller.journal`: which outcomes ``poll`` writes (``--log changes``: only
  what changed, and a summary line per round), pure.
- :mod:`gce_watchdog.poller.cloudlogging`: Cloud Logging's ``entries.list`` of the serial-port log
  (``--logging-evidence``).
- :mod:`gce_watchdog.poller.dump`: ``parse``'s reading and printing of a saved dump.
- :mod:`gce_watchdog.poller.cli`: ``gce-watchdog poll`` and ``parse`` (options only).
- :mod:`gce_watchdog.poller.ledger_cli`: ``gce-watchdog decisions`` and ``pin``, the ledger's
  operator commands (options only).

``docs/poller.md`` documents the decision table, the reader and the ledger.
"""
