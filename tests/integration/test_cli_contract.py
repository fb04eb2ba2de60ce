"""One CLI contract (docs/cli.md): exit 64 on a usage error in every command, every --help ends
with its exit codes, a closed pipe exits quietly, `config show` round-trips through `config
check`, `check --json`/`--npd`, `disarm --status` in words, ISO times on poller lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gce_watchdog import cli
from gce_watchdog.lib.cli import EX_CONFIG, EX_USAGE, all_parsers
from gce_watchdog.testing.simgce import SimGCE
from gce_watchdog.vm import config as cfgmod
from hypothesis import given
from hypothesis import strategies as st
from kit.cli import gcewd
from kit.paths import REPO

PARSERS = all_parsers(cli.build_parser())
LEAVES = [path for path, p in PARSERS if path and not p._subparsers]


def _gw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return gcewd(*args, env={**os.environ, **(env or {})})


@pytest.mark.pure
def test_every_command_has_its_exit_codes_and_help_ends_with_them() -> None:
    paths = {path for path, _ in PARSERS}
    assert paths == set(cli.EXIT_CODES), "a command without exit codes, or codes without one"
    assert len(LEAVES) >= 19
    for path, parser in PARSERS:
        text = parser.format_help()
        tail = text[text.rindex("exit status:") :]
        rows = re.findall(r"^  (\S+(?:, \S+)?)\s{2,}\S", tail, re.M)
        assert rows == [c for c, _ in cli.EXIT_CODES[path]], path
        assert text.endswith(tail) and tail.count("\n") == len(rows) + 1, path
        if path in LEAVES and path not in {("exec",)}:
            assert "64" in rows, path  # usage errors are 64 everywhere


@pytest.mark.pure
@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_every_command_exits_64_on_a_usage_error(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([*path, "--no-such-option"])
    assert e.value.code == EX_USAGE
    assert ": error: " in capsys.readouterr().err  # argparse's message, then exit 64


@pytest.mark.pure
def test_no_command_and_an_unknown_one_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main([]) == EX_USAGE
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == EX_USAGE


@pytest.mark.process
def test_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte (`| head -0`)
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "gce_watchdog",
                "config",
                "show",
                "--config",
                str(_cfg(tmp_path)),
            ],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    finally:
        os.close(w)
    assert p.stderr == ""  # no BrokenPipe traceback
    assert p.returncode == 141
    # the same with a real `head -1` reading a long output
    long = subprocess.run(
        f"{sys.executable} -m gce_watchdog --help | head -c 10 >/dev/null; "
        f"{sys.executable} -m gce_watchdog config show --config {_cfg(tmp_path)} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert long.stdout == "[agent]\n" and "Traceback" not in long.stderr


def _cfg(tmp: Path, text: str = "") -> Path:
    p = tmp / "config.toml"
    if not p.exists() or text:
        p.write_text(text)
    return p


@pytest.mark.process
def test_config_show_prints_toml_that_check_accepts_and_that_round_trips(tmp_path: Path) -> None:
    src = _cfg(
        tmp_path,
        '[agent]\ninterval = "1m30s"\nprobe_timeout = 0.5\naction = "dry-run"\n'
        '[egress]\ntargets = ["a.example:443", "[::1]:8443"]\ndns_timeout = "200ms"\n'
        '[memory]\nenabled = false\nclimb_command = ["logger", "it said \\"climb\\""]\n',
    )
    shown = _gw("config", "show", "--config", str(src))
    assert shown.returncode == 0, shown.stderr
    assert "True" not in shown.stdout and 'interval = "1m30s"' in shown.stdout
    assert 'probe_timeout = "500ms"' in shown.stdout and "enabled = false" in shown.stdout
    out = tmp_path / "shown.toml"
    out.write_text(shown.stdout)
    # config check accepts it, by --config and by the positional alias
    for args in (["--config", str(out)], [str(out)]):
        chk = _gw("config", "check", *args)
        assert chk.returncode == 0 and ": OK (digest" in chk.stdout, chk.stderr
    assert cfgmod.load(out) == cfgmod.load(src)
    # a fixed point without the source comments (they name the file each value came from)
    bare = _gw("config", "show", "--no-sources", "--config", str(src))
    out.write_text(bare.stdout)
    again = _gw("config", "show", "--no-sources", "--config", str(out))
    assert again.stdout == bare.stdout
    both = _gw("config", "check", "--config", str(out), str(src))
    assert both.returncode == EX_USAGE


@pytest.mark.pure
@given(
    interval=st.integers(min_value=100, max_value=3_600_000),
    threshold=st.integers(min_value=1, max_value=10_000),
    action=st.sampled_from(["poweroff", "stop", "delete", "dry-run"]),
    state_dir=st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=20
    ),
    band=st.floats(min_value=0.01, max_value=64, allow_nan=False),
)
def test_to_toml_round_trips_any_valid_config(
    interval: int, threshold: int, action: str, state_dir: str, band: float
) -> None:
    import tomllib

    try:
        cfg = cfgmod.replace(
            cfgmod.Config(),
            agent={
                "interval": cfgmod.Duration(interval / 1000),
                "threshold": threshold,
                "action": action,
                "state_dir": "/var/" + state_dir.replace("/", "_"),
            },
            memory={"band_gib": band},
        )
        cfgmod.from_dict(tomllib.loads(cfgmod.to_toml(cfg)))
    except cfgmod.InvalidConfig:
        return  # a combination the cross-field checks refuse: nothing to round-trip
    assert cfgmod.from_dict(tomllib.loads(cfgmod.to_toml(cfg))) == cfg


@pytest.mark.process
@pytest.mark.parametrize(
    ("toml", "want"),
    [
        ("interval = 5\n", "interval: a key outside its section: it belongs under [agent]"),
        ("intervall = 5\n", "did you mean 'interval' under [agent]?"),
        ("[agnet]\ninterval = 5\n", "agnet: unknown section (did you mean 'agent'?)"),
        ("agnt = 1\n", "did you mean the [agent] section?"),
    ],
)
def test_a_top_level_typo_gets_the_right_hint(tmp_path: Path, toml: str, want: str) -> None:
    r = _gw("config", "check", "--config", str(_cfg(tmp_path, toml)))
    assert r.returncode == EX_CONFIG and want in r.stderr, r.stderr


def _agent_cfg(tmp: Path, sim: SimGCE) -> Path:
    assert sim.tcp is not None
    return _cfg(
        tmp,
        f'[agent]\nprobe_timeout = "300ms"\nstate_dir = "{tmp}/state"\nrun_dir = "{tmp}/run"\n'
        f'boot_id_path = "{tmp}/boot_id"\n[metadata]\nurl = "{sim.metadata.url}"\n'
        f'[egress]\ntargets = ["127.0.0.1:{sim.tcp.port}"]\ndns_timeout = "200ms"\n',
    )


@pytest.mark.process
def test_check_json_and_npd_against_a_real_fake_gce(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("0" * 32 + "\n")
    with SimGCE() as sim:
        cfg = str(_agent_cfg(tmp_path, sim))
        ok = _gw("check", "--json", "--config", cfg)
        doc = json.loads(ok.stdout)
        assert ok.returncode == 0 and doc["verdict"] == "healthy" and doc["exit"] == 0
        assert doc["probes"]["metadata"]["verdict"] == "ok" and doc["threshold"] == 10
        assert _gw("check", "--npd", "--config", cfg).returncode == 0
        sim.outage(True)
        down = _gw("check", "--json", "--config", cfg)
        assert down.returncode == 2 and json.loads(down.stdout)["verdict"] == "outage"
        npd = _gw("check", "--npd", "--config", cfg)
        assert npd.returncode == 1  # NPD's NonOK
        assert npd.stdout.startswith("outage: metadata fail") and npd.stdout.count("\n") == 1
    bad = _cfg(tmp_path, "[agent]\nthreshold = 0\n")
    unknown = _gw("check", "--npd", "--config", str(bad))
    assert unknown.returncode == 2 and unknown.stdout.startswith("check could not run")
    assert _gw("check", "--config", str(bad)).returncode == EX_CONFIG
    assert _gw("check", "--json", "--npd").returncode == EX_USAGE


@pytest.mark.process
def test_disarm_status_is_plain(tmp_path: Path) -> None:
    (tmp_path / "serial.log").touch()
    cfg = _cfg(
        tmp_path,
        f'[agent]\nstate_dir = "{tmp_path}/state"\nrun_dir = "{tmp_path}/run"\n'
        f'[serial]\ndevice = "{tmp_path}/serial.log"\n',
    )
    r = _gw("disarm", "--status", "--config", str(cfg))
    assert r.returncode == 0
    assert r.stdout.startswith("armed; the metadata attribute gce-watchdog-disarm is read")
    assert "(armed)" not in r.stdout
    assert _gw("disarm", "--for", "1h30m", "--config", str(cfg)).returncode == 0
    r = _gw("disarm", "--status", "--config", str(cfg))
    assert re.match(r"disarmed locally until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; ", r.stdout)


@pytest.mark.pure
def test_poller_lines_carry_an_iso_timestamp() -> None:
    from gce_watchdog.poller import app as pcli
    from gce_watchdog.poller.verdict import Verdict, VerdictKind

    class Out:
        instance, instance_id, status, action, decision, reaped, reap_error = (
            "vm-1", "77", "RUNNING", "none", None, None, None,
        )  # fmt: skip
        error, read = None, None
        verdict = Verdict(VerdictKind.HEALTHY, "ok", "b1")

        def to_json(self) -> dict[str, object]:
            return {"instance": self.instance}

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        pcli._print_outcome(Out(), False, now=lambda: 1_764_475_094.0)
        pcli._print_outcome(Out(), True, now=lambda: 1_764_475_094.0)
    human, js = buf.getvalue().splitlines()
    assert human.startswith("2025-11-30T03:58:14Z vm-1 id=77 status=RUNNING")
    assert json.loads(js)["ts"] == "2025-11-30T03:58:14Z"
