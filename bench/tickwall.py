"""Tick wall time, measured inside the agent: ``python -m bench.tickwall --config PATH``.

Runs inside the vm namespace with the agent's real edges (``daemon.app.build_agent``): one
healthy tick first (it fills the DNS address cache, as a running agent would have), then prints
``ready``, waits for one line on stdin (the runner black-holes both paths meanwhile), runs
``--ticks`` ticks back to back and prints one JSON object: each tick's wall time
(``TickReport.duration``) and probe verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))


class _NoNotify:
    watchdog_interval = 0.0

    def notify(self, *assignments: str) -> bool:
        return False


def main(argv: list[str] | None = None) -> int:
    from gce_watchdog.daemon.app import build_agent
    from gce_watchdog.vm import config as cfgmod
    from gce_watchdog.vm.runtime import make_emitter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--ticks", type=int, default=10)
    a = ap.parse_args(argv)
    if not 1 <= a.ticks <= 1000:
        ap.error("--ticks must be 1..1000")
    cfg = cfgmod.load(a.config)
    emitter, port = make_emitter(cfg)
    agent, prober = build_agent(cfg, emitter, _NoNotify())
    try:
        first = agent.tick_once()
        print(json.dumps({"ready": True, "healthy_first": first.result.egress.verdict.value}),
              flush=True)  # fmt: skip
        sys.stdin.readline()  # the runner black-holes the paths, then writes a line
        rows = []
        for _ in range(a.ticks):
            r = agent.tick_once()
            rows.append(
                {
                    "duration_s": r.duration,
                    "md": f"{r.result.metadata.verdict.value}/{r.result.metadata.reason}",
                    "eg": f"{r.result.egress.verdict.value}/{r.result.egress.reason}",
                    "dns": r.result.dns,
                    "md_ms": r.result.metadata.latency_ms,
                    "eg_ms": r.result.egress.latency_ms,
                }
            )
        print(json.dumps({"ticks": rows}), flush=True)
    finally:
        prober.close()
        port.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
