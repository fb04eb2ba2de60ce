"""The Prometheus textfile exporter: a strict format parser, values that follow the ladder through
the real Agent, atomic replacement, and never raising."""

from __future__ import annotations

import math
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from gce_watchdog import __version__
from gce_watchdog.daemon.ladder import ProbeVerdict
from gce_watchdog.daemon.metrics import MetricsExporter, Snapshot, printable, render
from gce_watchdog.daemon.service import Agent, Deps, LadderStore
from gce_watchdog.daemon.tick import ProbeResult
from gce_watchdog.testing.synth import SYNTH_KEY
from gce_watchdog.vm import config as cfgmod
from gce_watchdog.vm.console import Emitter, MemorySink
from gce_watchdog.vm.state import SeqAllocator
from hypothesis import given
from hypothesis import strategies as st
from kit.fakes import FakeClock, FakeNotifier, ScriptedProber, result
from kit.prom import Series, parse_prom

pytestmark = pytest.mark.pure

# -- a strict parser for the text exposition format (0.0.4) ---------------------------------------


def val(series: Series, name: str, **labels: str) -> float:
    return series[(f"gce_watchdog_{name}", frozenset(labels.items()))]


# -- fixtures --------------------------------------------------------------------------------------


def cfg_for(d: Path, **metrics: object) -> cfgmod.Config:
    return cfgmod.replace(
        cfgmod.Config(),
        agent={"interval": 30.0, "probe_timeout": 5.0, "heartbeat_every": 3},
        metrics={"directory": str(d), **metrics},
    )


def make_agent(
    tmp: Path,
    script: list,
    exporter_kw: dict[str, object] | None = None,
    on_shutdown: Callable[..., None] | None = None,
) -> tuple[Agent, MetricsExporter, MemorySink, Path]:
    prom = tmp / "textfile"
    prom.mkdir()
    cfg = cfg_for(prom)
    clock = FakeClock()
    sink = MemorySink()
    exp = MetricsExporter.from_config(
        cfg, dropped=lambda: sink.dropped, clock=clock.wall, **(exporter_kw or {})
    )  # type: ignore[arg-type]
    deps = Deps(
        emitter=Emitter(sink, SeqAllocator(tmp, "0000abcd"), "0000abcd", clock.wall, key=SYNTH_KEY),
        prober=ScriptedProber(script, clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp / "ladder.json", "b1"),
        on_shutdown=on_shutdown or (lambda *a, **k: None),
        tick_hooks=[exp],
    )
    return Agent.from_config(cfg, deps), exp, sink, prom / "gce_watchdog.prom"


def read(path: Path) -> Series:
    return parse_prom(path.read_text())[0]


# -- values follow the ladder ----------------------------------------------------------------------


def test_values_follow_the_ladder_through_a_scripted_outage(tmp_path: Path) -> None:
    ok, both, one, unk = (
        result("ok", "ok"),
        result("fail", "fail"),
        result("fail", "ok"),
        result("unknown", "fail"),
    )
    script = [ok, ok, both, both, unk, both, one, *[both] * 12]
    agent, exp, _, path = make_agent(tmp_path, script)
    seen_rungs = []
    for n in range(1, len(script) + 1):
        rep = agent.tick_once()
        s = read(path)
        seen_rungs.append(int(val(s, "ladder_rung")))
        assert val(s, "ladder_rung") == rep.state.rung == agent.state.rung
        assert val(s, "ladder_threshold") == 10
        assert val(s, "ticks_total") == n
        assert val(s, "ladder_fired") == (1 if rep.state.fired else 0)
        r = script[n - 1]
        for probe, pr in (("metadata", r.metadata), ("egress", r.egress)):
            for v in ProbeVerdict:  # a state set: exactly one verdict is 1
                assert val(s, "probe_verdict", probe=probe, verdict=v.value) == (
                    1 if v is pr.verdict else 0
                )
            assert val(s, "probe_latency_seconds", probe=probe) == pytest.approx(0.005)
        assert val(s, "dns_ok") == 1
        assert val(s, "last_tick_timestamp_seconds") == pytest.approx(agent.d.clock.wall())
    # climb, hold on unknown, reset on one ok, climb to the threshold, stay there
    assert seen_rungs == [0, 0, 1, 2, 2, 3, 0, *range(1, 11), 10, 10]
    s = read(path)
    assert val(s, "shutdowns_decided_total") == 1  # once per boot, however long it lasts
    assert val(s, "would_shutdowns_total") == 0
    assert val(s, "serial_lines_dropped_total") == 0
    assert val(s, "build_info", version=__version__) == 1
    assert val(s, "metrics_write_errors_total") == 0
    assert exp.writes == len(script) and exp.errors == 0


def test_disarmed_threshold_counts_would_shutdowns(tmp_path: Path) -> None:
    agent, _, _, path = make_agent(tmp_path, [result("fail", "fail")])
    agent.d.armed = lambda: (False, "metadata")
    for _ in range(12):
        agent.tick_once()
    s = read(path)
    assert val(s, "would_shutdowns_total") == 1 and val(s, "shutdowns_decided_total") == 0


def test_memory_gauges_and_dropped_lines(tmp_path: Path) -> None:
    mem = {"host_used": 3.5 * 2**30, "gpu0_used": 22 * 2**30, 'odd"gauge\\x': 1.5}
    agent, _, sink, path = make_agent(
        tmp_path, [result("ok", "ok", dns="-")], {"memory": lambda: mem}
    )
    sink.dropped = 7
    agent.tick_once()
    s = read(path)
    assert val(s, "memory_bytes", gauge="host_used") == 3.5 * 2**30
    assert val(s, "memory_bytes", gauge="gpu0_used") == 22 * 2**30
    assert val(s, "memory_bytes", gauge='odd"gauge\\x') == 1.5  # escaped and parsed back
    assert val(s, "serial_lines_dropped_total") == 7
    assert not any(k[0] == "gce_watchdog_dns_ok" for k in s)  # no names to resolve: no series


def test_unprintable_gauge_names_cannot_break_the_file() -> None:
    snap = Snapshot(memory={"gpu0\nused": 1.0, "gpu0\rused": 2.0, "x\ud800": 3.0})
    out = render(snap)
    out.encode("utf-8")  # strict: nothing unencodable left
    s, _ = parse_prom(out)
    assert val(s, "memory_bytes", gauge="gpu0_used") == 1.0  # "\n" sorts before "\r": first wins
    assert val(s, "memory_bytes", gauge="x_") == 3.0


def test_a_broken_memory_source_costs_only_its_gauges(tmp_path: Path) -> None:
    def boom() -> Mapping[str, float]:
        raise RuntimeError("NVML went away")

    agent, exp, _, path = make_agent(tmp_path, [result("ok", "ok")], {"memory": boom})
    agent.tick_once()
    s = read(path)
    assert val(s, "ladder_rung") == 0
    assert not any(k[0] == "gce_watchdog_memory_bytes" for k in s)
    assert exp.errors == 0


def test_wrap_shutdown_writes_decided_before_the_chain_runs(tmp_path: Path) -> None:
    seen: list[Series] = []
    path_box: list[Path] = []

    def chain(reason: str, rung: int, thr: int, **k: object) -> None:  # a real one never returns
        seen.append(read(path_box[0]))

    prom = tmp_path / "textfile"
    prom.mkdir()
    cfg = cfg_for(prom)
    clock = FakeClock()
    exp = MetricsExporter.from_config(cfg, dropped=lambda: 0, clock=clock.wall)
    path_box.append(prom / "gce_watchdog.prom")
    sink = MemorySink()
    deps = Deps(
        emitter=Emitter(
            sink, SeqAllocator(tmp_path, "0000abcd"), "0000abcd", clock.wall, key=SYNTH_KEY
        ),
        prober=ScriptedProber([result("fail", "fail")], clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp_path / "ladder.json", "b1"),
        on_shutdown=exp.wrap_shutdown(chain),
        tick_hooks=[exp],
    )
    agent = Agent.from_config(cfg, deps)
    for _ in range(12):
        agent.tick_once()
    (before,) = seen
    assert val(before, "ladder_rung") == 10 and val(before, "ladder_fired") == 1
    assert val(before, "shutdowns_decided_total") == 1
    assert val(read(path_box[0]), "shutdowns_decided_total") == 1  # not counted twice


# -- the file --------------------------------------------------------------------------------------


def test_atomic_replace_mode_and_no_leftovers(tmp_path: Path) -> None:
    agent, exp, _, path = make_agent(tmp_path, [result("ok", "ok")])
    old_umask = os.umask(0o077)  # the agent's umask must not hide the file from node_exporter
    try:
        agent.tick_once()
        ino = path.stat().st_ino
        agent.tick_once()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.stat().st_ino != ino  # replaced by rename, not rewritten in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["gce_watchdog.prom"]
    assert not exp.tmp_path.endswith(".prom")  # node_exporter never reads the temporary file


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    agent, _, _, path = make_agent(tmp_path, [result("ok", "ok"), result("fail", "fail")])
    agent.tick_once()
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        for _ in range(100_000):  # bounded
            if stop.is_set():
                return
            try:
                parse_prom(path.read_text())
            except AssertionError as e:
                bad.append(str(e))
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(300):
            agent.tick_once()
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive() and bad == []


def test_missing_directory_is_skipped_not_created_and_never_raises(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path / "no-node-exporter")
    exp = MetricsExporter.from_config(cfg, dropped=lambda: 0)
    agent, _, _, _ = make_agent(tmp_path, [result("ok", "ok")])
    agent.d.tick_hooks[:] = [exp]
    agent.tick_once()
    assert exp.missing_dir == 1 and exp.errors == 0 and exp.writes == 0
    assert not (tmp_path / "no-node-exporter").exists()


def test_write_errors_are_counted_and_reported_in_the_next_file(tmp_path: Path) -> None:
    agent, exp, _, path = make_agent(tmp_path, [result("ok", "ok")])
    path.mkdir()  # rename over a directory fails (EISDIR): an OSError the hook must swallow
    exp(agent.tick_once())  # called directly as well: it must not raise either
    assert exp.errors == 2 and "gce_watchdog.prom" in exp.last_error
    assert not Path(exp.tmp_path).exists()
    path.rmdir()
    agent.tick_once()
    assert val(read(path), "metrics_write_errors_total") == 2


def test_disabled_writes_nothing(tmp_path: Path) -> None:
    prom = tmp_path / "d"
    prom.mkdir()
    exp = MetricsExporter.from_config(cfg_for(prom, enabled=False), dropped=lambda: 0)
    agent, _, _, _ = make_agent(tmp_path, [result("ok", "ok")])
    agent.d.tick_hooks[:] = [exp]
    agent.tick_once()
    assert list(prom.iterdir()) == []


def test_write_cost_per_tick(tmp_path: Path) -> None:
    agent, exp, _, _ = make_agent(
        tmp_path,
        [result("fail", "fail")],
        {"memory": lambda: {f"gpu{i}_used": 1e9 * i for i in range(8)}},
    )
    reps = [agent.tick_once() for _ in range(3)]
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        exp(reps[-1])
    per = (time.perf_counter() - t0) / n
    print(f"metrics: {per * 1e6:.0f} us per tick (render + write + rename)")
    assert exp.errors == 0 and per < 0.02  # generous: 2 shared CI cores


# -- config ----------------------------------------------------------------------------------------


def test_metrics_config_defaults_and_errors() -> None:
    m = cfgmod.Config().metrics
    assert m.enabled and m.directory == "/var/lib/prometheus/node-exporter"
    assert m.filename == "gce_watchdog.prom"
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.from_dict(
            {"metrics": {"directory": "relative/dir", "filename": "x.txt", "enabeld": True}}
        )
    msg = str(ei.value)
    assert "metrics.directory: must be an absolute path" in msg
    assert "metrics.filename: must be a plain file name ending in .prom" in msg
    assert "did you mean 'enabled'" in msg
    for bad in ("../x.prom", ".hidden.prom", "a/b.prom"):
        with pytest.raises(cfgmod.InvalidConfig):
            cfgmod.from_dict({"metrics": {"filename": bad}})


# -- the format, for any values --------------------------------------------------------------------


@given(
    rung=st.integers(0, 1000),
    lat=st.integers(0, 10**7),
    verdict=st.sampled_from(list(ProbeVerdict)),
    dns=st.sampled_from(["ok", "fail", "-"]),
    mem=st.dictionaries(
        st.text(min_size=1, max_size=20), st.floats(allow_nan=True, allow_infinity=True), max_size=5
    ),
    ticks=st.integers(0, 2**62),
)
def test_render_always_parses(
    rung: int, lat: int, verdict: ProbeVerdict, dns: str, mem: dict[str, float], ticks: int
) -> None:
    pr = ProbeResult(verdict, "x", lat)
    snap = Snapshot(
        rung=rung,
        metadata=pr,
        egress=pr,
        dns=dns,
        memory=mem,
        ticks=ticks,
        last_tick=1.8e9,
        tick_duration=0.25,
    )
    s, types = parse_prom(render(snap))
    assert val(s, "ladder_rung") == rung and val(s, "ticks_total") == float(ticks)
    assert types["gce_watchdog_ticks_total"] == "counter"
    assert len([k for k in s if k[0] == "gce_watchdog_memory_bytes"]) == len(
        {printable(k) for k in mem}
    )
    for k, v in mem.items():
        if k != printable(k):
            continue  # unprintable characters became "_" (and may collide: first one wins)
        got = val(s, "memory_bytes", gauge=k)
        assert (math.isnan(got) and math.isnan(v)) or got == v


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    # The textfile directory may belong to node_exporter's user; the agent runs as root.
    agent, exp, _, path = make_agent(tmp_path, [result("ok", "ok")])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, exp.tmp_path)
    agent.tick_once()
    assert victim.read_text() == "precious\n"
    assert val(read(path), "ticks_total") == 1 and exp.errors == 0
    os.link(victim, exp.tmp_path)  # a hard link: unlinked, not truncated
    agent.tick_once()
    assert victim.read_text() == "precious\n"
    assert val(read(path), "ticks_total") == 2


# -- prometheus_client's own parser as an oracle ---------------------------------------------------


def oracle(text: str) -> tuple[Series, dict[str, str]]:
    """The file as prometheus_client (the reference implementation's Python client) reads it:
    every sample and every family's type. Its parser names a counter family without
    ``_total`` and its samples with it."""
    from prometheus_client.parser import text_string_to_metric_families

    series: Series = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
        for smp in fam.samples:
            key = (smp.name, frozenset(smp.labels.items()))
            assert key not in series, f"duplicate series {key}"
            assert smp.timestamp is None  # node_exporter's textfile collector refuses them
            series[key] = smp.value
    return series, types


def _same(a: Series, b: Series) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


def test_the_reference_parser_reads_what_the_agent_writes(tmp_path: Path) -> None:
    script = [result("ok", "ok"), *[result("fail", "fail")] * 11]
    mem = {"host_used": 3.5 * 2**30, 'odd"gauge\\x\n': 1.5, "nan": math.nan}
    agent, exp, _, path = make_agent(tmp_path, script, {"memory": lambda: mem})
    agent.d.on_shutdown = exp.wrap_shutdown(lambda *a, **k: None)
    for _ in script:
        agent.tick_once()
        text = path.read_text()
        got, types = oracle(text)
        mine, my_types = parse_prom(text)
        assert _same(got, mine)
        assert types == my_types
    assert got[("gce_watchdog_shutdowns_decided_total", frozenset())] == 1
    assert got[("gce_watchdog_armed", frozenset())] == 1
    assert types["gce_watchdog_armed"] == "gauge"
    assert types["gce_watchdog_dry_run_decisions_total"] == "counter"


@given(
    mem=st.dictionaries(
        st.text(min_size=1, max_size=20), st.floats(allow_nan=True, allow_infinity=True), max_size=5
    ),
    version=st.text(max_size=20),
    armed=st.sampled_from([None, True, False]),
    dry=st.booleans(),
    n=st.integers(0, 2**62),
)
def test_the_reference_parser_agrees_on_any_snapshot(
    mem: dict[str, float], version: str, armed: bool | None, dry: bool, n: int
) -> None:
    pr = ProbeResult(ProbeVerdict.FAIL, "x", 12)
    snap = Snapshot(
        metadata=pr,
        egress=pr,
        memory=mem,
        version=version,
        armed=armed,
        dry_run=dry,
        shutdowns=n,
        dry_runs=n // 3,
        last_tick=1.8e9,
    )
    text = render(snap)
    got, types = oracle(text)
    mine, my_types = parse_prom(text)
    assert _same(got, mine) and types == my_types
    assert (("gce_watchdog_armed", frozenset()) in got) == (armed is not None)


# -- dry runs and the armed gauge ------------------------------------------------------------------


def _dry_agent(tmp_path: Path, script: list) -> tuple[Agent, MetricsExporter, Path, list[str]]:
    prom = tmp_path / "textfile"
    prom.mkdir()
    cfg = cfgmod.replace(cfg_for(prom), agent={"action": "dry-run"})
    clock = FakeClock()
    sink = MemorySink()
    exp = MetricsExporter.from_config(cfg, dropped=lambda: 0, clock=clock.wall)
    chains: list[str] = []
    deps = Deps(
        emitter=Emitter(
            sink, SeqAllocator(tmp_path, "0000abcd"), "0000abcd", clock.wall, key=SYNTH_KEY
        ),
        prober=ScriptedProber(script, clock),
        clock=clock,
        notifier=FakeNotifier(),
        store=LadderStore(tmp_path / "ladder.json", "b1"),
        on_shutdown=exp.wrap_shutdown(lambda reason, *a, **k: chains.append(reason)),
        tick_hooks=[exp],
    )
    return Agent.from_config(cfg, deps), exp, prom / "gce_watchdog.prom", chains


def test_a_dry_run_decision_is_its_own_series_never_a_shutdown(tmp_path: Path) -> None:
    # Two outages, each reaching the threshold, with a recovery between them.
    both, ok = result("fail", "fail"), result("ok", "ok")
    script = [*[both] * 12, ok, *[both] * 10]
    agent, _, path, chains = _dry_agent(tmp_path, script)
    seen = []
    for _ in script:
        agent.tick_once()
        s = read(path)
        seen.append(val(s, "dry_run_decisions_total"))
        assert val(s, "shutdowns_decided_total") == 0  # a pilot never looks like a real one
        assert val(s, "would_shutdowns_total") == 0
        assert val(s, "armed") == 0 and val(s, "dry_run") == 1
        assert val(s, "ladder_fired") == 0
    assert len(chains) == 2  # the chain was rehearsed at each decision ...
    assert seen[9] == 1 and seen[-1] == 2  # ... and each was counted once, at the decision
    assert seen[:9] == [0] * 9


def test_a_disarmed_dry_run_is_a_would_shutdown(tmp_path: Path) -> None:
    agent, _, path, chains = _dry_agent(tmp_path, [result("fail", "fail")])
    agent.d.armed = lambda: (False, "metadata")
    for _ in range(12):
        agent.tick_once()
    s = read(path)
    assert chains == [] and val(s, "dry_run_decisions_total") == 0
    assert val(s, "would_shutdowns_total") == 1


def test_the_armed_gauge_follows_the_disarm_gate(tmp_path: Path) -> None:
    agent, _, _, path = make_agent(tmp_path, [result("ok", "ok")])
    gate = {"armed": True}
    agent.d.armed = lambda: (gate["armed"], "armed" if gate["armed"] else "metadata")
    got = []
    for armed in (True, False, False, True):
        gate["armed"] = armed
        agent.tick_once()
        s = read(path)
        got.append(val(s, "armed"))
        assert val(s, "dry_run") == 0
    assert got == [1, 0, 0, 1]


def test_no_armed_series_before_the_first_tick() -> None:
    s, _ = parse_prom(render(Snapshot()))
    assert not any(k[0] == "gce_watchdog_armed" for k in s)
    assert val(s, "dry_run") == 0


def test_serial_reopens_are_exported(tmp_path: Path) -> None:
    port = MemorySink(reopens=3)  # a port's counter, read by the exporter at each tick
    agent, _, _, path = make_agent(
        tmp_path, [result("ok", "ok")], {"reopens": lambda: port.reopens}
    )
    agent.tick_once()
    assert val(read(path), "serial_reopens_total") == 3


def test_the_daemon_wires_the_ports_reopen_counter(tmp_path: Path) -> None:
    from gce_watchdog.daemon.app import build_agent

    cfg = cfgmod.replace(
        cfg_for(tmp_path), agent={"state_dir": str(tmp_path), "run_dir": str(tmp_path / "run")}
    )
    sink = MemorySink(reopens=5)
    em = Emitter(sink, SeqAllocator(tmp_path, "0000abcd"), "0000abcd", key=SYNTH_KEY)
    agent, prober = build_agent(cfg, em, FakeNotifier())
    try:
        exporters = [h for h in agent.d.tick_hooks if isinstance(h, MetricsExporter)]
        assert [e.reopens() for e in exporters] == [5]
    finally:
        prober.close()
