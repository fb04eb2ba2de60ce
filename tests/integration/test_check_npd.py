"""`check --npd`, node-problem-detector's custom plugin: its exit codes agree everywhere they are
written (the exit table, --help, the man page, docs/cli.md) and with what it does, and it answers
within 4 s whatever the network does (NPD kills a plugin at 5 s by default and reads that as
Unknown)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gce_watchdog import cli
from gce_watchdog.daemon import app
from gce_watchdog.lib.cli import all_parsers
from gce_watchdog.testing.simgce import FakeDNS, SimGCE
from hypothesis import given
from hypothesis import strategies as st
from kit.cli import gcewd
from kit.paths import DOCS, REPO

# node-problem-detector's custom plugin statuses (pkg/custompluginmonitor/types: OK = 0,
# NonOK = 1, Unknown = 2; any other exit status is Unknown too).
NPD = {"OK": 0, "NonOK": 1, "Unknown": 2}
NPD_WORDS = "|".join(NPD)


def _npd_rows(rows: list[tuple[str, str]]) -> dict[str, str]:
    """``{code: NPD status}`` from exit-table rows that say ``--npd: <Status>``."""
    out = {}
    for code, why in rows:
        m = re.search(rf"--npd: (?:\d+, )?({NPD_WORDS})\b", why)
        if m:
            out[code] = m.group(1)
    return out


@pytest.mark.process
def test_the_npd_codes_agree_in_the_table_help_man_page_docs_and_code(tmp_path: Path) -> None:
    rows = list(cli.EXIT_CODES[("check",)])
    said = _npd_rows(rows)
    # Every status NPD knows is in the table, on the row of its own number.
    assert {said[str(code)] for code in NPD.values()} == set(NPD), said
    assert all(said[str(code)] == word for word, code in NPD.items())
    assert (NPD["OK"], NPD["NonOK"], NPD["Unknown"]) == (app.NPD_OK, app.NPD_NONOK, app.NPD_UNKNOWN)
    assert "3" not in [c for c, _ in rows], "check --npd never exits 3"
    # --help prints the same rows, and the option's own help and description say the same.
    parser = dict(all_parsers(cli.build_parser()))[("check",)]
    text = " ".join(parser.format_help().split())
    for code, why in rows:
        assert f"{code} {' '.join(why.split())}" in text, code
    npd_help = next(a.help for a in parser._actions if "--npd" in a.option_strings)
    assert ", ".join(f"{code} {word}" for word, code in NPD.items()) in str(npd_help)
    said_desc = re.findall(rf"\b(\d) ({NPD_WORDS})\b", str(parser.description))
    assert said_desc == [(str(code), word) for word, code in NPD.items()]
    # The man page's EXIT STATUS comes from the same table (tools/cli_docs.py, make cli-docs).
    inc = tmp_path / "exit.include"
    r = subprocess.run(
        [sys.executable, "tools/cli_docs.py", "exit-status", str(inc)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    page = inc.read_text().split("\\fBgce-watchdog check\\fR\n", 1)[1].split(".TP", 1)[0]
    man = [tuple(ln.removesuffix("\n.br").split(": ", 1)) for ln in page.split(".br\n") if ln]
    assert _npd_rows([(c, w) for c, w in man]) == said
    # The docs say the same mapping.
    for doc in ("cli.md", "agent.md"):
        flat = " ".join((DOCS / doc).read_text().split()).replace("**", "")
        assert all(f"{code} {word}" in flat for word, code in NPD.items()), doc


@contextmanager
def blackholed() -> Iterator[int]:
    """A loopback port whose SYNs are dropped, as a firewall DROP does: a listener with a full
    accept queue that never accepts (Linux drops a SYN while the listener's accept queue is full,
    tcp_conn_request() in net/ipv4/tcp_input.c). Yields the port."""
    lsn = socket.socket()
    fill: list[socket.socket] = []
    try:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(0)
        port = int(lsn.getsockname()[1])
        for _ in range(3):  # backlog 0 queues one; the others wait in SYN retries
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fill.append(c)
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", port))
            raise AssertionError("the port is not blackholed: a connect went through")
        except TimeoutError:
            pass
        finally:
            probe.close()
        yield port
    finally:
        for c in fill:
            c.close()
        lsn.close()


@pytest.mark.process
def test_an_outage_answers_nonok_within_4s_with_the_default_timeouts(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("0" * 32 + "\n")
    # The defaults (probe_timeout 5 s, dns_timeout 2 s): alone they would take 5 s and more.
    with SimGCE() as sim, FakeDNS() as dns, blackholed() as port:
        dns.mode = "silent"  # DNS never answers
        sim.outage(True)  # the metadata server accepts and never answers
        cfg = tmp_path / "config.toml"
        cfg.write_text(
            f'[agent]\nstate_dir = "{tmp_path}/state"\nrun_dir = "{tmp_path}/run"\n'
            f'boot_id_path = "{tmp_path}/boot_id"\n[metadata]\nurl = "{sim.metadata.url}"\n'
            f'[egress]\ntargets = ["127.0.0.1:{port}", "www.example.com:{port}"]\n'
            f'dns_servers = ["127.0.0.1:{dns.port}"]\n'
        )
        t0 = time.monotonic()
        r = gcewd("check", "--npd", "--config", str(cfg), timeout=30)
        took = time.monotonic() - t0
    assert r.returncode == NPD["NonOK"], r.stdout + r.stderr
    assert r.stdout.startswith("outage: metadata fail") and "egress fail timeout" in r.stdout
    assert took < app.NPD_DEADLINE_S == 4.0, f"{took:.2f}s"


@pytest.mark.pure
@given(
    probe=st.floats(0.01, 300),
    ratio=st.floats(0.001, 0.999),
    left=st.floats(-10, 600),
)
def test_npd_timeouts_fit_the_deadline_and_keep_their_order(
    probe: float, ratio: float, left: float
) -> None:
    timeout, dns, cap = app.npd_timeouts(probe, probe * ratio, left)
    assert 0 < dns < timeout <= probe
    assert cap == timeout + app.NPD_CAP_SLACK_S
    budget = max(app.NPD_MIN_PROBE_S, left - app.NPD_ANSWER_S)
    assert timeout <= budget * (1 + 1e-9)
    if probe <= budget:
        assert timeout == probe, "what fits is not shortened"


@pytest.mark.pure
def test_process_age_reads_the_start_time_after_the_command_name(tmp_path: Path) -> None:
    import os

    hz = os.sysconf("SC_CLK_TCK")
    started = time.clock_gettime(time.CLOCK_BOOTTIME) - 2.5
    fields = ["S", *["0"] * 18, str(int(started * hz)), *["0"] * 30]
    stat = tmp_path / "stat"
    stat.write_text("42 (odd) name (x) " + " ".join(fields) + "\n")
    assert 2.4 <= app.process_age(str(stat)) <= 2.5 + 10 / hz + 5
    stat.write_text("garbage")
    assert app.process_age(str(stat)) == 0.0
    assert app.process_age(str(tmp_path / "missing")) == 0.0
    assert 0.0 < app.process_age() < time.monotonic() + 1  # this process: started, in the past
