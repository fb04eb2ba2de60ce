"""Run the VM scenarios in N pytest processes at once (``make e2e``; docs/e2e.md, "Time").

Each scenario is one guest booted from a fresh disk to its own power-off; nothing is shared
between two of them but the built image, wheelhouse and baked image (``e2e/build-image.sh``
locks its output folder, so two shards asking for the baked image build it once). A guest
spends most of its wall time waiting (2 s ticks, a linger, a fault's TTL), so two guests side
by side take far less than two after each other.

:func:`assign` is the pure part: the tests split by their measured cost, longest first, each to
the least loaded shard (LPT), so every shard gets the same list for the same tests. The shard
a pytest process runs is ``GCEWD_E2E_SHARD=I/N`` (``tests/e2e/conftest.py`` deselects the
rest). :func:`main` starts the N processes, keeps each one's output in ``build/e2e/shard-I.log``,
prints it whole once that shard ends, and fails when any shard failed. A SIGTERM to it is
passed on to every shard once (their pytest tears down what it started: tests/kit/sigterm.py);
a terminal's Ctrl-C reaches the shards by itself (one process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType

from e2e import vm

SHARD_ENV = "GCEWD_E2E_SHARD"
DEFAULT_SHARDS = 2

# Seconds each test took in a clean clone's make test beside a second one (proofs H and I,
# 2026-12-05; docs/e2e.md): only their order matters. A test not listed costs DEFAULT_COST.
COSTS: Mapping[str, float] = {
    "test_validate_wedge_and_done_against_booted_vms": 370.0,
    "test_dns_late_bootstrap_retries_and_succeeds": 290.0,
    "test_healthy_workload_completes": 270.0,
    "test_flapping_outage_never_shuts_down": 235.0,
    "test_dns_never_is_setup_failed_infra_and_fails_over": 187.0,
    "test_poller_unit_runs_under_systemd_with_its_token_from_a_credential": 175.0,
    "test_wedge_shuts_down_and_fails_over_once": 165.0,
    "test_setup_failed_job_never_fails_over_and_is_reaped": 160.0,
    "test_a_bad_config_attribute_is_setup_failed_job_with_the_error": 142.0,
    "test_config_by_metadata_is_a_drop_in_the_agent_runs_with": 140.0,
    "test_spot_preemption_through_the_fake_fails_over_once": 115.0,
    "test_deb_installs_runs_and_removes_clean": 60.0,
    "test_bake_image_into_a_tree_gives_an_agent_that_runs_there": 45.0,
}
DEFAULT_COST = 200.0
WAIT_AFTER_SIGNAL = 120.0  # for the shards' teardown once a signal was passed on


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 1 <= I <= N; ValueError with what is wrong otherwise."""
    i_s, sep, n_s = text.partition("/")
    if not sep or not i_s.isdigit() or not n_s.isdigit():
        raise ValueError(f"{SHARD_ENV}={text!r}: expected I/N, e.g. 1/2")
    i, n = int(i_s), int(n_s)
    if not 1 <= i <= n:
        raise ValueError(f"{SHARD_ENV}={text!r}: I must be 1..N")
    return i, n


def cost(nodeid: str) -> float:
    """A test's cost by its function's name (its parameters share it)."""
    name = nodeid.rsplit("::", 1)[-1].split("[", 1)[0]
    return COSTS.get(name, DEFAULT_COST)


def assign(nodeids: Iterable[str], n: int) -> list[list[str]]:
    """Split the tests into n shards: longest first, each to the shard with the least cost so
    far (ties: the lower shard; equal costs: the node id), each shard in collection order."""
    if n < 1:
        raise ValueError("at least one shard")
    ids = list(dict.fromkeys(nodeids))
    order = {nid: k for k, nid in enumerate(ids)}
    load = [0.0] * n
    shards: list[list[str]] = [[] for _ in range(n)]
    for nid in sorted(ids, key=lambda x: (-cost(x), x)):
        k = min(range(n), key=lambda j: (load[j], j))
        load[k] += cost(nid)
        shards[k].append(nid)
    return [sorted(s, key=order.__getitem__) for s in shards]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.shards [--logs DIR] N PYTEST_ARGS...``: N pytest processes, one shard
    each; their output in DIR/shard-I.log (default build/e2e)."""
    args = list(sys.argv[1:] if argv is None else argv)
    logs = Path(__file__).resolve().parents[1] / "build" / "e2e"
    if len(args) >= 2 and args[0] == "--logs":
        logs, args = Path(args[1]), args[2:]
    if not args or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m e2e.shards [--logs DIR] N [pytest arguments]", file=sys.stderr)
        return 64
    n, rest = int(args[0]), args[1:]
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[int, subprocess.Popen[bytes], Path]] = []
    got: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        # A SIGTERM is passed on once; a terminal's Ctrl-C reaches the shards by itself (one
        # process group), and a second interrupt would cut their teardown short.
        if signum == signal.SIGTERM and signal.SIGTERM not in got:
            for _, p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        got.append(signum)

    t0 = time.monotonic()
    # Prepared once here (or by `python -m e2e.vm image` with the same token, as make e2e
    # does): the shards' fixtures then reuse it instead of building the wheelhouse N times.
    token = os.environ.get(vm.PREPARED_ENV) or f"shards-{os.getpid()}-{time.time_ns()}"
    os.environ[vm.PREPARED_ENV] = token
    # Only for the VM tests (GCEWD_E2E=1, as make e2e sets); where they cannot run, each
    # shard's fixture skips, saying why.
    if os.environ.get("GCEWD_E2E") == "1" and vm.unavailable() is None:
        try:
            vm.prepare()
        except vm.E2EError as e:
            print(f"e2e shards: {e}", file=sys.stderr)
            return 1
    # A SIGINT ignored (a background job of a shell) stays ignored, here and in the shards.
    mine = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        mine.append(signal.SIGINT)
    old = {s: signal.signal(s, forward) for s in mine}
    try:
        for i in range(1, n + 1):
            log = logs / f"shard-{i}.log"
            env = {**os.environ, SHARD_ENV: f"{i}/{n}"}
            with log.open("wb") as out:
                p = subprocess.Popen(
                    [sys.executable, "-m", "pytest", *rest], stdout=out, stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            procs.append((i, p, log))
            print(f"e2e shard {i}/{n}: pid {p.pid}, output in {log}", flush=True)
        rcs: dict[int, int] = {}
        pending = list(procs)
        while pending:
            for item in list(pending):
                i, p, log = item
                try:
                    rc = p.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    continue
                rcs[i] = rc
                pending.remove(item)
                took = time.monotonic() - t0
                print(f"\n===== e2e shard {i}/{n}: rc={rc} after {took:.0f}s =====", flush=True)
                sys.stdout.buffer.write(log.read_bytes())
                sys.stdout.flush()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for _, p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(WAIT_AFTER_SIGNAL)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    # pytest's 5 is "no tests collected": a shard a -k left empty, fine beside one that ran.
    ran = any(rc == 0 for rc in rcs.values())
    bad = {i: rc for i, rc in sorted(rcs.items()) if rc != 0 and not (rc == 5 and ran)}
    print(f"e2e shards: {n} in {time.monotonic() - t0:.0f}s; failed: {bad or 'none'}", flush=True)
    return 1 if bad or got else 0


if __name__ == "__main__":
    raise SystemExit(main())
