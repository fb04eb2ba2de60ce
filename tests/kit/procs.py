"""Racing processes: start them, gather their results, reap them all (bounded)."""

from __future__ import annotations

from typing import Any


def gather(procs: list[Any], results: Any, n: int, wait_s: float) -> list[Any]:
    """Start ``procs`` (multiprocessing processes), take ``n`` results from the ``results``
    queue (each within ``wait_s``), join every process and check it exited 0; whatever
    happens, no process is left running."""
    try:
        for p in procs:
            p.start()
        out = [results.get(timeout=wait_s) for _ in range(n)]
        for p in procs:
            p.join(timeout=wait_s)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out
