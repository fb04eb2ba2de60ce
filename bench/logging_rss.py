"""RSS of the daemon's import path with and without structlog (issue 39, docs/performance.md,
"One logging path"): each case in a fresh child interpreter, RSS read with psutil after the
imports, the median of N runs. ``rich`` (and structlog's other optional dev renderers) are
blocked so that the dev venv reads like the shipped wheel, which has none of them.

    .venv/bin/python bench/logging_rss.py [N]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

BLOCK = "import sys\nfor m in ('rich', 'better_exceptions', 'colorama'): sys.modules[m] = None\n"
DAEMON = "import gce_watchdog.cli, gce_watchdog.daemon.cli, gce_watchdog.daemon.app\n"
MEASURE = "import psutil\nprint(psutil.Process().memory_info().rss)\n"
STRUCTLOG = "import structlog, structlog.processors\n"
CASES = {
    "daemon path (as it is now)": BLOCK + DAEMON,
    "daemon path + import structlog": BLOCK + DAEMON + STRUCTLOG,
    "bare interpreter + psutil": BLOCK,
    "dev venv (rich importable): daemon path + import structlog": DAEMON + STRUCTLOG,
}


def rss_mib(code: str, n: int) -> float:
    runs = []
    for _ in range(n):
        out = subprocess.run(
            [sys.executable, "-c", code + MEASURE],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout  # fmt: skip
        runs.append(int(out.split()[-1]) / 2**20)
    return statistics.median(runs)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(json.dumps({name: round(rss_mib(code, n), 1) for name, code in CASES.items()}))


if __name__ == "__main__":
    main()
