"""The agent's journal entries as a REAL systemd-journald stores them (`journalctl -o json`):
journald runs in a private mount and PID namespace (unshare) with its own tmpfs /run/systemd and
/run/log, so the host's journal and sockets are never touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from kit.journal import CHILD

pytestmark = pytest.mark.netns

JOURNALD = next(
    (
        p
        for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald")
        if os.path.exists(p)
    ),
    None,
)

# -- a real journald ------------------------------------------------------------------------------

REAL = textwrap.dedent(
    """
    set -eu
    # Private mounts (this is a new mount namespace): journald's sockets and journal files live
    # in tmpfs here and nowhere else; the host's /run/systemd and logs are never touched.
    mount -t tmpfs tmpfs /run/systemd
    mkdir -p /run/systemd/journal /run/log
    mount -t tmpfs tmpfs /run/log
    if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi
    "$JOURNALD" &
    jd=$!
    trap 'kill $jd 2>/dev/null || true' EXIT
    n=0
    until [ -S /run/systemd/journal/socket ] && [ -S /run/systemd/journal/stdout ]; do
        n=$((n + 1)); [ $n -lt 300 ] || { echo "journald did not start" >&2; exit 97; }
        sleep 0.1
    done
    export STREAM_TO=/run/systemd/journal/stdout
    TAG=native "$PY" -c "$CHILD"
    TAG=fallback GCEWD_JOURNAL_SOCKET=/run/absent "$PY" -c "$CHILD"
    # Wait (bounded) until journald has stored all six entries, then print them.
    n=0
    while :; do
        set -- /run/log/journal/*
        out=$(journalctl -q -D "$1" -o json SYSLOG_IDENTIFIER=gce-watchdog 2>&1 || true)
        [ "$(printf '%s' "$out" | grep -c . || true)" -ge 6 ] && break
        n=$((n + 1)); [ $n -lt 300 ] || { echo "journal: $out" >&2; exit 98; }
        sleep 0.1
    done
    printf '%s\\n' "$out"
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0
    or JOURNALD is None
    or not shutil.which("unshare")
    or not shutil.which("journalctl"),
    reason="needs root, unshare, systemd-journald and journalctl",
)
def test_a_real_journald_stores_our_fields() -> None:
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
         "bash", "-c", REAL],
        env={**os.environ, "JOURNALD": str(JOURNALD), "PY": sys.executable, "CHILD": CHILD},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if p.returncode != 0 and "unshare failed" in p.stderr:
        pytest.skip(f"no namespaces here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    entries = [json.loads(ln) for ln in p.stdout.splitlines() if ln.strip()]
    native = [e for e in entries if e.get("GCEWD_TAG") == "native"]
    assert [e["GCEWD_EVENT"] for e in native] == ["tick", "heartbeat", "dry_run_shutdown"]
    tick = native[0]
    assert tick["PRIORITY"] == "4" and tick["GCEWD_RUNG"] == "3/10"
    assert tick["GCEWD_MD"] == "fail/timeout/5000" and tick["GCEWD_LEVEL"] == "warning"
    assert tick["GCEWD_TEXT"] == "BOTH failed\nsecond line"  # the length-encoded value, intact
    assert tick["MESSAGE"].startswith("tick rung=3/10 md=fail/timeout/5000")
    assert tick["_TRANSPORT"] == "journal"  # journald's own word: the native protocol
    assert native[2]["PRIORITY"] == "4"  # a dry run: a warning (issue 39)
    # No native socket: the prefixed lines through the stream, priorities read by journald.
    plain = [e for e in entries if e.get("_TRANSPORT") == "stdout"]
    assert len(plain) == 3, entries
    assert [e["PRIORITY"] for e in plain] == ["4", "6", "4"]
    assert all("GCEWD_EVENT" not in e for e in plain)
    assert "event='tick'" in plain[0]["MESSAGE"] and "tag='fallback'" in plain[0]["MESSAGE"]
