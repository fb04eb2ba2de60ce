"""The benchmark cannot rot: its pure parts, and the runner end to end in its tiny mode.

No timing is asserted anywhere: only that every section ran and produced numbers of the right
shape (docs/performance.md holds the real figures, from ``make bench``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kit.netns import (
    PY,
    delete_ns,
    harness_namespaces,
    iptables_unavailable,
    netns_unavailable,
    ns_pids,
)
from kit.paths import REPO
from kit.wait import wait_for

sys.path.insert(0, str(REPO))

from bench import analysis, peers, report
from bench import run as run_mod

IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:       241 |        241 |     _json
import time:       318 |        885 |   json.decoder
import time:       228 |       1457 | json
import time:      1000 |       3000 | gce_watchdog.daemon.probes
something else on stderr
"""


@pytest.mark.pure
def test_summarize_reports_median_and_quartiles() -> None:
    s = analysis.summarize([5, 1, 3, 2, 4])
    assert (s["n"], s["median"], s["p25"], s["p75"], s["min"], s["max"]) == (5, 3, 2, 4, 1, 5)
    assert analysis.summarize([])["median"] is None
    assert analysis.summarize([7])["p75"] == 7


@pytest.mark.pure
def test_policy_bounds_and_window_rates() -> None:
    assert analysis.policy_bounds(0.5, 10, 0.25) == (4.5, 5.25)
    assert analysis.per_window_rates([(10, 100.0), (20, 130.0), (20, 131.0), (30, 150.0)]) == [
        3.0,
        1.9,
    ]


@pytest.mark.pure
def test_importtime_parse_depths_and_packages() -> None:
    rows = analysis.parse_importtime(IMPORTTIME)
    assert [(r.module, r.depth) for r in rows] == [
        ("_json", 2),
        ("json.decoder", 1),
        ("json", 0),
        ("gce_watchdog.daemon.probes", 0),
    ]
    b = analysis.import_breakdown(rows)
    assert b["top_level"][0]["module"] == "gce_watchdog.daemon.probes"
    assert {p["package"]: p["self_ms"] for p in b["packages"]}["json"] == pytest.approx(0.546)


@pytest.mark.pure
def test_tables_are_replaced_between_markers_only() -> None:
    doc = "intro\n<!-- bench:decode -->\nold\n<!-- /bench:decode -->\nhand-written\n"
    res = {"decode": {"skipped": "no corpus"}}
    out, n = report.replace_tables(doc, res)
    assert n == 1 and "old" not in out and "no corpus" in out
    assert out.startswith("intro\n") and out.endswith("hand-written\n")


@pytest.mark.pure
def test_targets_flag_a_miss() -> None:
    res = {"overhead": {"default": {"fast": {"rss_mib": 40.0, "cpu_ms_per_tick": {"median": 1.0}}}}}
    t = {x["target"]: x for x in report.targets(res)}
    assert t["RSS after 100 healthy ticks (dev venv)"]["met"] is False
    assert t["CPU per healthy tick"]["met"] is True
    assert t["process start to first tick"]["met"] is None  # not measured: not a pass
    shipped = "RSS after 100 healthy ticks (as shipped: system python3, wheel)"
    assert t[shipped]["met"] is None  # no .bench-venv: not measured, not a pass


@pytest.mark.pure
def test_soak_growth_is_a_target_row() -> None:
    t = {x["target"]: x for x in report.targets({"soak": {"ticks": 20000, "growth_mib": 1.2}})}
    row = t["RSS growth over a 20000-tick soak (healthy, then outage)"]
    assert row["met"] is False and row["goal"] == "<= 1 MiB"
    t = {x["target"]: x for x in report.targets({"soak": {"ticks": 20000, "growth_mib": 0.6}})}
    assert t["RSS growth over a 20000-tick soak (healthy, then outage)"]["met"] is True


@pytest.mark.pure
def test_deps_floor_is_its_own_target_row() -> None:
    """The floor row comes from the import table (the shipped interpreter first); above the
    target it says the RSS target is out of reach whatever the agent's own code does."""
    floor = {"import": run_mod.DEPS_FLOOR_LABEL, "rss_mib": 32.8, "added_mib": 18.0}
    res = {"startup": {"rss_by_import_mib": [dict(floor, rss_mib=33.8)],
                       "rss_by_import_deployed_mib": [floor]}}  # fmt: skip
    rows = [x for x in report.targets(res) if x["target"].startswith("floor")]
    assert len(rows) == 1 and rows[0]["measured"] == 32.8 and rows[0]["met"] is False
    assert "as shipped" in rows[0]["target"]
    res["startup"]["rss_by_import_deployed_mib"] = None  # only the dev venv measured
    (row,) = [x for x in report.targets(res) if x["target"].startswith("floor")]
    assert row["measured"] == 33.8 and "(dev)" in row["target"]
    table = report.t_rss_imports(res)
    assert "as shipped" not in table and "33.8" in table
    # The measured floor (26.9 MiB as shipped) is under the restated 32 MiB target.
    res["startup"]["rss_by_import_deployed_mib"] = [dict(floor, rss_mib=26.9)]
    (row,) = [x for x in report.targets(res) if x["target"].startswith("floor")]
    assert row["met"] is True


@pytest.mark.pure
def test_the_journal_section_runs_tiny_and_is_a_target_row() -> None:
    """Issue 38: the poller's output in bytes a day, --log every against --log changes, through
    the poller's own filter and formatter (bench/journal.py)."""
    from bench import journal

    res = journal.simulate(50, 30.0, 0.2)
    assert res["rounds"] == 24 and res["outcomes"] == 50 * 24
    e, c = res["every"], res["changes"]
    # every: one line per VM per round and the round line, the first round counted once
    assert e["lines_per_day"] == pytest.approx(51 * 2880, rel=0.01)
    assert 0 < c["mb_per_day"] < e["mb_per_day"] and c["lines_per_day"] >= 2880
    assert c["first_round_bytes"] > 50 * 500  # every VM's first sight, once
    assert res["object_bytes_mean"] > 500  # a real outcome object, evidence and all
    assert journal.simulate(50, 30.0, 0.2) == res  # seeded: the same figures every run
    t = {x["target"]: x for x in report.targets({"journal": res})}
    row = t["poller journal, 1,000 VMs at 30 s (--log changes)"]
    assert row["measured"] == c["mb_per_day"] and row["goal"] == "<= 50 MB a day"
    table = report.t_journal({"journal": res})
    assert "--log changes (the unit)" in table and "MB a day" in table


def _loaded_row(name: str, timeout: float, values: list[float], within: int) -> dict[str, object]:
    lo, hi = analysis.policy_bounds(1.0, 10, timeout)
    return {"name": name, "kind": "agent", "interval": 1.0, "threshold": 10, "timeout": timeout,
            "expresses_and": True, "bounds_s": [lo, hi], "latency_s": analysis.summarize(values),
            "values_s": values, "within_bounds": within, "missed": 0, "fired_before_fault": 0,
            "past_bound_ms": max(values) * 1000 - hi * 1000}  # fmt: skip


@pytest.mark.pure
def test_loaded_detection_is_a_table_and_a_target_row_per_ratio() -> None:
    """Issue 38 item 7: every loaded run inside the window at timeout/interval 0.5, 0.9, 0.99;
    one run outside is a miss of that ratio's row only."""
    ws = {
        "agent-1s": _loaded_row("agent-1s", 0.5, [9.9] * 6, 6),
        "agent-1s-t0.9": _loaded_row("agent-1s-t0.9", 0.9, [10.2] * 6, 6),
        "agent-1s-t0.99": _loaded_row("agent-1s-t0.99", 0.99, [10.5] * 5 + [11.1], 5),
    }
    res = {"detection_loaded": {
        "runs": 6, "watchers": ws, "loadavg_1m": analysis.summarize([6.0, 7.5]),
        "load": {"busy_procs": 4, "cores": 2, "how": "4 x busy loop"}}}  # fmt: skip
    rows = {
        t["target"]: t for t in report.targets(res) if t["target"].startswith("detection under")
    }
    assert len(rows) == 3
    met = {k.split(", ")[1].split(" ")[0]: v["met"] for k, v in rows.items()}
    assert met == {"agent-1s": True, "agent-1s-t0.9": True, "agent-1s-t0.99": False}
    assert any("(4 busy processes)" in k and "0.99" in k for k in rows)
    table = report.t_detection_loaded(res)
    assert (
        "4 x busy loop on 2 cores" in table and "5/6" in table and "agent-1s-t0.99 110 ms" in table
    )
    assert report.t_detection_loaded({}) == "_not measured in this run_"


@pytest.mark.pure
def test_peer_files_never_name_system_paths(tmp_path: Path) -> None:
    for w in peers.peer_watchers(10, 0.5):
        ln = peers.launch(w, tmp_path / w.name, PY, "192.0.2.10")
        text = "".join(p.read_text() for p in ln.workdir.iterdir() if p.is_file())
        assert "/etc/" not in text and "/dev/watchdog" not in text
        if w.kind == "watchdog":
            assert "-q" in ln.argv and ln.argv[:2] == ["unshare", "--pid"]
            assert "watchdog-device" not in text and "repair-maximum = 0" in text
        if w.kind == "monit":
            assert (ln.workdir / "monitrc").stat().st_mode & 0o777 == 0o600


@pytest.mark.netns
@pytest.mark.slow
def test_tiny_bench_runs_every_section(tmp_path: Path) -> None:
    why = netns_unavailable() or iptables_unavailable()
    if why:
        pytest.skip(f"netns: {why}")
    out = tmp_path / "r.json"
    doc = tmp_path / "perf.md"
    doc.write_text("<!-- bench:targets -->\n<!-- /bench:targets -->\n")
    r = subprocess.run(
        [PY, "-m", "bench.run", "--tiny", "--out", str(out), "--doc", str(doc)],
        cwd=str(REPO), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(v.startswith(("ok", "skipped")) for v in res["sections"].values()), res["sections"]
    # the fleet section is make bench's (test_bench_fleet_smoke runs it tiny): said, not run
    assert res["sections"]["fleet"].startswith("skipped: tiny mode") and "fleet" not in res
    assert res["startup"]["spawn_to_first_tick_ms"]["n"] == 1
    assert res["overhead"]["default"]["fast"]["ticks"] >= 10
    imports = {r["import"]: r for r in res["startup"]["rss_by_import_mib"]}
    assert imports[run_mod.DEPS_FLOOR_LABEL]["rss_mib"] > imports["python (bare)"]["rss_mib"]
    if run_mod.deploy_py():  # `make bench` built the shipped-like venv: it was measured too
        assert res["overhead"]["default"]["fast_deployed"]["ticks"] >= 10
    assert res["blackhole"]["tick_wall_s"]["n"] == 2
    det = res["detection"]["watchers"]
    assert det["agent-0.5s"]["latency_s"]["n"] == 1
    loaded = res["detection_loaded"]  # issue 38 item 7: the same watchers, the machine loaded
    assert loaded["load"]["busy_procs"] == 2 * (os.cpu_count() or 1)
    assert loaded["watchers"]["agent-1s-t0.99"]["latency_s"]["n"] == 1
    assert loaded["loadavg_1m"]["n"] == 1
    for ratio in ("t0.9", "t0.99"):  # issue 16: timeouts close to the interval, within bounds
        row = det[f"agent-1s-{ratio}"]
        assert row["latency_s"]["n"] == 1 and row["within_bounds"] == 1, row
    soak = res["soak"]
    assert soak["ticks"] == 2000 and soak["tick_errors"] == 0 and soak["rung_at_end"] == 1000
    journal = res["journal"]  # issue 38: both --log modes of a 1,000-VM fleet, tiny
    assert journal["vms"] == 1000 and journal["changes"]["mb_per_day"] > 0
    assert journal["changes"]["mb_per_day"] < journal["every"]["mb_per_day"]
    if res["peers_skipped"] is None:  # monit/watchdog installed: they were measured too
        assert {"monit-native", "watchdog-test"} <= set(det)
    assert "| target |" in doc.read_text()


def _netns_of(pid: int) -> list[str]:
    return [name for name, maker in harness_namespaces() if maker == pid]


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie does not: nothing of it is left but its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.netns
@pytest.mark.slow
def test_a_terminated_bench_tears_down_what_it_started(tmp_path: Path) -> None:
    """A bench stopped by SIGTERM mid-run (a CI job's timeout, ``kill``, ``timeout(1)``)
    leaves nothing behind, as after Ctrl-C: its namespaces, the simulated GCE and every
    process it started in them are gone when it exits (they were left running: the default
    SIGTERM ran no teardown)."""
    why = netns_unavailable() or iptables_unavailable()
    if why:
        pytest.skip(f"netns: {why}")
    argv = [PY, "-m", "bench.run", "--tiny", "--no-doc", "--no-fleet", "--out", str(tmp_path / "r")]
    with (tmp_path / "log").open("w") as log:
        p = subprocess.Popen(argv, cwd=str(REPO), stdout=log, stderr=log)
    started: list[int] = []
    try:

        def running() -> bool:  # the run's namespaces, with its processes in them
            started[:] = [pid for ns in _netns_of(p.pid) for pid in ns_pids(ns)]
            return len(started) >= 2 or p.poll() is not None

        assert wait_for(running, 120, 0.05) and p.poll() is None, (tmp_path / "log").read_text()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(120)
        assert rc != 0 and not _netns_of(p.pid), (tmp_path / "log").read_text()[-2000:]
        assert [pid for pid in started if _alive(pid)] == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        for ns in _netns_of(p.pid):  # the test's own teardown when the bench's failed
            delete_ns(ns)


@pytest.mark.process
def test_bench_decode_script_writes_json(tmp_path: Path) -> None:
    import importlib.util

    path = REPO / "bench" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r" / "decode.json"
    argv = [str(out), "--size", "65536", "--repeats", "1", "--process-size", "65536"]
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["bytes"] == 65536 and res["grep_count"] == res["marker_lines"] > 0
    # like for like (issue 38): whole process against whole process, in process against the
    # in-process floor; never the one against the other
    assert res["decode_mb_s"] > 0 and res["ratio_decode_to_count"] > 0
    assert res["process_big"]["bytes"] == 65536 and res["ratio_process_to_grep"] > 0
    assert res["parse_empty_median_s"] > 0 and res["parse_import_ms"] > 0
    assert "ratio_decode_to_grep" not in res
    # the floors of any Python decoder (issue 38, item 2), against the same references: the
    # in-process one finds every intact line of ours, the whole-process one prints them
    assert res["floor_lines"] == res["events"] - res["rejected"] > 0
    assert res["ratio_floor_to_count"] > 0 and res["verify_ms_in_decode"] > 0
    assert res["process_big"]["floor_cpu_median_s"] > 0 and res["ratio_floor_process_to_grep"] > 0
    for shape in ("bad_sig", "max_fields", "cr", "cr_lines"):
        for piece in ("", "_64k", "_4k"):
            assert res[f"hostile_{shape}{piece}_ms_per_mib"] > 0


@pytest.mark.pure
def test_every_hostile_shape_is_a_row_and_the_slowest_a_target() -> None:
    dec = {"hostile_cr_ms_per_mib": 23.0, "hostile_walkdown_ms_per_mib": 51.0,
           "hostile_walkdown_verified": 224, "ratio_process_to_grep": 3.0}  # fmt: skip
    assert report.hostile_shapes(dec) == [("cr", 23.0), ("walkdown", 51.0)]
    (row,) = [x for x in report.targets({"decode": dec}) if x["target"].startswith("slowest")]
    assert row["target"] == "slowest hostile 1 MiB shape (walkdown)" and row["met"] is False
    dec["hostile_walkdown_ms_per_mib"] = 49.0
    (row,) = [x for x in report.targets({"decode": dec}) if x["target"].startswith("slowest")]
    assert row["met"] is True and row["measured"] == 49.0


@pytest.mark.process
def test_only_decode_reruns_that_section_and_keeps_the_others(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    doc = tmp_path / "perf.md"
    doc.write_text("<!-- bench:decode -->\n<!-- /bench:decode -->\n")
    old = {
        "mode": "full",
        "date": "2026-01-01T00:00:00Z",
        "soak": {"ticks": 20000, "growth_mib": 0.5},
        "sections": {"soak": "ok in 1.0s", "decode": "ok in 9.0s"},
        "decode": {"stale": 1},
    }
    out.write_text(json.dumps(old))
    r = subprocess.run(
        [PY, "-m", "bench.run", "--tiny", "--only-decode", "--out", str(out), "--doc", str(doc)],
        cwd=str(REPO), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["soak"] == old["soak"] and res["date"] == old["date"] and res["mode"] == "full"
    assert "stale" not in res["decode"] and res["decode"]["ratio_process_to_grep"] > 0
    assert (
        res["sections"]["decode"].startswith("ok") and "re-run alone" in res["sections"]["decode"]
    )
    assert res["decode"]["date"] != old["date"] and "--only-decode" in res["decode"]["mode"]
    assert "measured alone" in doc.read_text()


@pytest.mark.pure
def test_the_debs_tree_is_a_target_row_and_says_when_it_was_not_measured() -> None:
    """Issue 38 item 1: the soak under the .deb's own venv is its own row; with no .deb built
    the row says so (None), never the wheel's figure."""
    name = (
        "RSS at the end of the soak, None idle processes beside it"
        " (the .deb's tree; `make deb` first)"
    )
    t = {x["target"]: x for x in report.targets({"soak": {"rss_end_mib": 29.0}})}
    assert t[name]["measured"] is None and t[name]["met"] is None
    soak = {"idle_procs": 300, "rss_end_mib": 29.0, "deb_tree": {"rss_end_mib": 33.5}}
    t = {x["target"]: x for x in report.targets({"soak": soak})}
    row = t[name.replace("None", "300")]
    assert row["measured"] == 33.5 and row["met"] is False


def _fleet(p99: float = 3.0, rate: float = 1200.0, handled: int = 100, once: bool = True) -> dict:
    poll = {"vms": 5000, "workers": 32, "round_cold_s": 33.0, "round_steady_s": 14.4,
            "cpu_ms_per_vm_steady": 2.5, "api_calls_per_round": {"serial": 5000, "list": 10},
            "decision_latency_s": {"p50": 11.0, "p99": 14.0, "max": 14.5}, "decisions": 500,
            "wedged": 500, "exactly_once": True}  # fmt: skip
    ps = {"vms": 5000, "workers": 3, "ledger": "postgresql", "published": 100,
          "messages_handled": handled, "publish_rate_per_s": rate, "messages_per_s": 1250.0,
          "elapsed_s": 60.0, "decision_latency_s": {"p50": 1.0, "p99": p99, "max": p99 + 0.1},
          "ready_latency_s": {"p50": 0.1, "p99": 0.2, "max": 0.3}, "decisions": 3000,
          "wedged": 3000, "exactly_once": once, "finished_ended": True,
          "healthy_undecided": True, "worker_rss_mib": [86.9, 87.0, 87.1],
          "worker_cpu_s": [9.0, 9.5, 9.1], "messages_per_cpu_s": 2700.0,
          "loadavg_1m": {"min": 1.0, "max": 2.5, "samples": [1.0, 2.5]}}  # fmt: skip
    small = dict(ps, vms=1000, decision_latency_s={"p50": 9.0, "p99": 99.0, "max": 99.0})
    return {"polling": [dict(poll, vms=1000), poll], "pubsub": [small, ps], "args": ["--x"]}


P99 = ("Pub/Sub 5,000 VMs, 3 workers, {} messages/s published: decision latency p99 (publish to"
       " claim)")  # fmt: skip
ONCE = ("Pub/Sub 5,000 VMs: every wedged VM decided exactly once, no finished or healthy VM, the"
        " whole stream handled")  # fmt: skip


@pytest.mark.pure
def test_the_fleet_section_is_target_rows_of_its_largest_fleets() -> None:
    """Issue 38 item 4: the fleet's figures are targets of the same run, each of the largest
    fleet measured; a p99 over 5 s, a rate under 1,200/s, a decision not exactly once or a
    stream not handled whole is a miss; without the section the rows say "not measured"."""
    t = {x["target"]: x for x in report.targets({"fleet": _fleet()})}
    assert t[P99.format("1,200")]["measured"] == 3.0 and t[P99.format("1,200")]["met"] is True
    assert t[ONCE]["met"] is True and t[ONCE]["measured"] == "3000 of 3000"
    assert t["polling 5,000 VMs: steady round (every VM read once)"]["met"] is True
    cpu = t["polling 5,000 VMs: poller CPU per VM a round (its process start included)"]
    assert cpu["measured"] == 2.5 and cpu["met"] is False
    assert t["polling 5,000 VMs: every wedged VM decided exactly once"]["met"] is True
    t = {x["target"]: x for x in report.targets({"fleet": _fleet(p99=5.2)})}
    assert t[P99.format("1,200")]["met"] is False
    t = {x["target"]: x for x in report.targets({"fleet": _fleet(rate=600.0, p99=0.1)})}
    assert t[P99.format("600")]["met"] is False  # fast, but at half the target's rate
    for bad in (_fleet(handled=99), _fleet(once=False)):
        assert {x["target"]: x for x in report.targets({"fleet": bad})}[ONCE]["met"] is False
    t = {x["target"]: x for x in report.targets({})}
    assert t[P99.format("1,200")]["met"] is None and t[ONCE]["measured"] is None
    assert report.t_fleet({}) == "_not measured in this run_"
    table = report.t_fleet({"fleet": _fleet()})
    assert "polling, 5,000 VMs" in table and "Pub/Sub, 1,000 VMs" in table
    assert "**3.00**" in table and "86.9, 87.0, 87.1 MiB" in table and "--x" in table
    skipped = report.t_fleet({"fleet": {"polling": [], "pubsub": [{"skipped": "no java"}]}})
    assert "skipped: no java" in skipped


@pytest.mark.pure
def test_the_decode_table_shows_the_python_floors_beside_the_goals() -> None:
    """Issue 38, item 2: the floors of any Python decoder are rows of the decode table, against
    the same references; a run from before them shows none (no row made up)."""
    big = {"floor_median_s": 0.166, "grep_median_s": 0.0218, "ratio_floor_to_grep": 7.6}
    dec = {"process_big": big, "floor_median_s": 0.00068, "count_median_s": 0.00046,
           "ratio_floor_to_count": 1.5, "decode_verified": 15, "verify_ms_in_decode": 0.59,
           "ratio_verify_to_count": 1.3}  # fmt: skip
    rows = report._floor_rows(dec)
    assert [r[1] for r in rows] == [
        "166 ms / 21.8 ms = 7.6x", "0.68 ms / 0.46 ms = 1.5x", "0.59 ms / 0.46 ms = 1.3x"
    ]  # fmt: skip
    assert "15 x verify" in rows[2][0]
    # and target rows saying whether each goal is reachable at all (the deps' floor's pattern)
    dec["ratio_floor_process_to_grep"] = 7.6
    got = {x["target"].split(" vs ")[0]: x for x in report.targets({"decode": dec})}
    whole = got["floor: the least any Python `parse --json` does (read, find each line of ours,"
                " one JSON object each)"]  # fmt: skip
    assert whole["measured"] == 7.6 and whole["met"] is False
    inproc = got["floor: the marker scan, a CRC and a regex match per line of ours, and the"
                 " signature checks `decode_all` makes"]  # fmt: skip
    assert inproc["measured"] == 2.8 and inproc["met"] is True
    del big["floor_median_s"]
    assert report._floor_rows(dec) == []
