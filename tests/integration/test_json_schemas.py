"""Every ``--json`` output is the documented, versioned schema (docs/json.md, issue 39 item 8).

Real outputs, made by the real commands (``poll`` against the fake Compute API over HTTP,
``check`` against SimGCE, ``parse``/``report`` of a dump, ``decisions`` of the ledger poll
wrote), validated against the JSON Schema files shipped in ``gce_watchdog/schemas/``; every
string that looks like a time is RFC 3339 UTC and no field holds an epoch number.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from gce_watchdog.cli import main
from gce_watchdog.lib import jsontime
from gce_watchdog.poller.ledgers import open_ledger
from gce_watchdog.testing.simcompute import FakeComputeAPI
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.testing.synth import Writer
from kit.cli import gcewd
from kit.paths import DOCS
from kit.poll import poll_args
from kit.schemas import SCHEMAS, schema
from kit.schemas import validate as _validate

# Most tests read the real commands' outputs (the `outputs` fixture runs them).
pytestmark = pytest.mark.process

# The outputs this file makes in-process; fault inject/status need root and network namespaces:
# tests/root/test_faults.py validates those against theirs.
NAMES = (
    "poll", "check", "parse", "report", "decisions", "decisions-held", "decisions-alarms",
    "validate-plan",
)  # fmt: skip
ALL = (*NAMES, "fault-inject", "fault-status")
# A string that starts like a date is a time; it must then be RFC 3339 UTC, the one format.
LOOKS_LIKE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d")
# Keys that would hold an epoch time if a number slipped back in.
TIME_KEY = re.compile(r"(^ts$|_at$|_ts$|^ts_|_rx$|received)")


def run(argv: list[str]) -> tuple[int, list[dict[str, Any]]]:
    """The root CLI in this process: its status and the JSON objects it printed, one a line."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(argv)
    return rc, [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.strip()]


def failover_dump() -> bytes:
    w = Writer(boot="aaaa0001")
    return (
        b"[    0.000000] Linux version 5.10.0-26-cloud-amd64\r\n"
        + w.line("phase", {"ph": "workload"})
        + w.line("tick", {"rung": "1/10", "md": "fail/timeout/5001", "eg": "fail/refused/0"})
        + w.line(
            "fault", {"id": "f1", "op": "inject", "cut": "md", "until": "2099-01-01T00:00:00Z"}
        )
        + w.line("mem", {"hu": "2.5", "climb": "0"})
        + w.line("shutdown", {"reason": "ladder", "rung": "10/10"}, "10/10: shutting down")
    )


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Each command's real JSON objects, by schema name."""
    tmp = tmp_path_factory.mktemp("json")
    log = tmp / "serial.log"
    log.write_bytes(failover_dump())
    out: dict[str, list[dict[str, Any]]] = {}
    with FakeComputeAPI(token="tok") as api:
        api.add_instance("vm-1", project="test-project", zone="us-central1-a")
        api.add_instance("vm-2", project="test-project", zone="us-central1-a")
        api.add_instance("vm-3", project="test-project", zone="us-central1-a")
        api.append_serial("vm-1", failover_dump())
        api.append_serial("vm-3", failover_dump())
        # read vm-2 once before its line comes: the line is then received new, and healthy
        # (a first read alone would not tell its age: docs/poller.md, "Freshness")
        run(poll_args(api, tmp, "--once", "vm-2"))
        healthy = Writer(boot="bbbb0002")
        healthy.ts_ms = int(time.time() * 1000)
        api.append_serial("vm-2", healthy.line("phase", {"ph": "workload"}))
        # a brake of one failover per 10 minutes: vm-1 fails over, vm-3 is held
        argv = poll_args(api, tmp, "--once", "--brake", "1%/10m/1", "vm-1", "vm-2", "vm-3")
        out["poll"] = run([*argv, "vm-gone"])[1]  # a failover, a healthy VM, a hold, an error
    ledger = str(tmp / "ledger.sqlite")
    out["decisions"] = run(["decisions", "--ledger", ledger, "--json"])[1]
    out["decisions-held"] = run(["decisions", "held", "--ledger", ledger, "--json"])[1]
    with open_ledger(ledger) as led:  # a VM that left the fleet's label selection while running
        led.decisions.raise_alarm(
            "4000000000000000009", "vm_untracked", "test-project/us-central1-a/vm-9", "RUNNING",
            {"gce-watchdog-job": "j1"},
        )  # fmt: skip
    out["decisions-alarms"] = run(["decisions", "alarms", "--ledger", ledger, "--json"])[1]
    out["parse"] = run(["parse", str(log), "--json", "--now", "last"])[1]
    out["report"] = run(["report", str(log), "--json", "--now", "last"])[1]
    out["check"] = check_outputs(tmp)
    image = "projects/p/global/images/agent"  # a plan only: nothing is created
    plan = ["validate", "--plan", "--json", "--project", "p", "--zone", "us-central1-a"]
    out["validate-plan"] = run([*plan, "--image", image])[1]
    yield out


def check_outputs(tmp: Path) -> list[dict[str, Any]]:
    """``check --json`` as a process against SimGCE, healthy and in an outage."""
    (tmp / "boot_id").write_text("0" * 32 + "\n")
    docs = []
    with SimGCE() as sim:
        assert sim.tcp is not None
        cfg = tmp / "config.toml"
        cfg.write_text(
            f'[agent]\nprobe_timeout = "300ms"\nstate_dir = "{tmp}/state"\n'
            f'run_dir = "{tmp}/run"\nboot_id_path = "{tmp}/boot_id"\n'
            f'[metadata]\nurl = "{sim.metadata.url}"\n'
            f'[egress]\ntargets = ["127.0.0.1:{sim.tcp.port}"]\ndns_timeout = "200ms"\n'
        )
        for outage in (False, True):
            sim.outage(outage)
            r = gcewd("check", "--json", "--config", str(cfg))
            assert r.returncode in (0, 2), r.stderr
            docs.append(json.loads(r.stdout))
    return docs


@pytest.mark.parametrize("name", ALL)
def test_every_schema_is_a_valid_draft_2020_12_schema_with_a_version(name: str) -> None:
    s = schema(name)
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert s["properties"]["v"]["const"] >= 1 and "v" in s["required"]
    assert s["$defs"]["time"]["pattern"] == jsontime.PATTERN, "one time format in every schema"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "check"])
def test_real_outputs_validate_against_their_schema(
    outputs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = outputs[name]
    assert docs, f"{name} printed nothing"
    for doc in docs:
        _validate(name, doc)
        assert doc["v"] == schema(name)["properties"]["v"]["const"]


def test_poll_covers_a_failover_a_healthy_vm_and_an_error(
    outputs: dict[str, list[dict[str, Any]]],
) -> None:
    by = {d["instance"]: d for d in outputs["poll"]}
    assert by["vm-1"]["action"] == "failover" and by["vm-1"]["decision"]["token"] == 1
    assert by["vm-2"]["verdict"] == "healthy" and by["vm-2"]["decision"] is None
    assert by["vm-3"]["action"] == "held" and by["vm-3"]["decision"]["held"] is True
    assert by["vm-gone"]["error"] and by["vm-gone"]["verdict"] is None
    # the decision's time is the decisions view's string, not an epoch number
    assert by["vm-1"]["decision"]["decided_at"] == outputs["decisions"][0]["decided_at"]


def test_check_output_validates_except_its_version(
    outputs: dict[str, list[dict[str, Any]]],
) -> None:
    """daemon/app.py writes check's JSON; its `v` lands with the daemon's branch (below)."""
    s = schema("check")
    loose = {**s, "required": [k for k in s["required"] if k != "v"]}
    assert [d["verdict"] for d in outputs["check"]] == ["healthy", "outage"]
    for doc in outputs["check"]:
        jsonschema.Draft202012Validator(loose).validate(doc)


def test_check_output_carries_its_version(outputs: dict[str, list[dict[str, Any]]]) -> None:
    for doc in outputs["check"]:
        _validate("check", doc)


def undocumented(node: dict[str, Any], doc: Any, root: dict[str, Any], path: str) -> list[str]:
    """Keys of ``doc`` the schema ``node`` does not describe (readers may meet new fields, so the
    schemas allow them; this repository's own outputs must document every one)."""
    if "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in node:  # a value or null: the alternative that is not null describes it
        if doc is None:
            return []
        (alt,) = [a for a in node["anyOf"] if a.get("type") != "null"]
        return undocumented(alt, doc, root, path)
    out: list[str] = []
    if isinstance(doc, dict) and "properties" in node:
        for k, v in doc.items():
            if k not in node["properties"]:
                out.append(f"{path}.{k}")
            else:
                out += undocumented(node["properties"][k], v, root, f"{path}.{k}")
    elif isinstance(doc, list) and isinstance(node.get("items"), dict):
        for i, v in enumerate(doc):
            out += undocumented(node["items"], v, root, f"{path}[{i}]")
    return out


def test_every_field_of_every_output_is_in_its_schema(
    outputs: dict[str, list[dict[str, Any]]],
) -> None:
    missing = [
        f"{name}{path}"
        for name, docs in outputs.items()
        for doc in docs
        for path in undocumented(schema(name), doc, schema(name), "")
    ]
    assert missing == [], "describe these fields in gce_watchdog/schemas/ and docs/json.md"


def test_the_field_check_finds_a_new_field(outputs: dict[str, list[dict[str, Any]]]) -> None:
    doc = {**outputs["poll"][0], "decision": {**outputs["poll"][0]["decision"], "extra": 1}}
    assert undocumented(schema("poll"), doc, schema("poll"), "") == [".decision.extra"]


def _walk(doc: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, doc


def test_one_time_format_everywhere(outputs: dict[str, list[dict[str, Any]]]) -> None:
    times = 0
    for name, docs in outputs.items():
        for doc in docs:
            for path, value in _walk(doc):
                key = path.rsplit(".", 1)[-1].split("[", 1)[0]
                if isinstance(value, str) and LOOKS_LIKE_TIME.match(value):
                    assert re.match(jsontime.PATTERN, value), f"{name}{path}: {value!r}"
                    times += 1
                elif TIME_KEY.search(key) and value is not None:
                    assert isinstance(value, str), f"{name}{path} is {value!r}, not RFC 3339"
    assert times >= 20  # events, boots, series, decisions: a broken walk would find none


def test_a_schema_rejects_an_epoch_time_and_a_missing_version(
    outputs: dict[str, list[dict[str, Any]]],
) -> None:
    poll = next(d for d in outputs["poll"] if d["decision"] is not None)
    bad = {**poll, "decision": {**poll["decision"], "decided_at": 1764561600.5}}
    with pytest.raises(jsonschema.ValidationError):
        _validate("poll", bad)
    with pytest.raises(jsonschema.ValidationError):
        _validate("parse", {k: v for k, v in outputs["parse"][0].items() if k != "v"})
    report = outputs["report"][0]
    with pytest.raises(jsonschema.ValidationError):
        _validate("report", {**report, "boots": [{**report["boots"][0], "first_ts": 0}]})


def test_docs_json_md_lists_every_schema_and_its_version() -> None:
    text = (DOCS / "json.md").read_text()
    for name in ALL:
        assert f"schemas/{name}.schema.json" in text, name
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(f"{n}.schema.json" for n in ALL)


def test_every_verdict_enum_is_the_verdicts_of_the_code() -> None:
    """A verdict added to poller/verdict.py must reach every schema that lists the verdicts."""
    from gce_watchdog.poller.verdict import VerdictKind

    kinds = {k.value for k in VerdictKind}
    found = 0

    def walk(node: Any) -> None:
        nonlocal found
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and "self_shutdown" in enum:
                found += 1
                assert {e for e in enum if e is not None} == kinds, sorted(kinds ^ set(enum))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in SCHEMAS.glob("*.schema.json"):
        walk(json.loads(path.read_text()))
    assert found >= 5
