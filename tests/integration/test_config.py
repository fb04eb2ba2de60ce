"""Config: defaults, every error reported at once, cross-field checks, the CLI's exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
from gce_watchdog.lib.durations import parse_duration
from gce_watchdog.vm import config as cfgmod
from kit.cli import gcewd
from kit.paths import REPO


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


@pytest.mark.pure
def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = cfgmod.Config()
    assert cfg.agent.interval == 30.0 and cfg.agent.threshold == 10
    assert cfg.metadata.url == "http://169.254.169.254/computeMetadata/v1/instance/id"
    assert cfg.serial.device == "/dev/ttyS0"
    assert cfgmod.from_dict({}) == cfg


@pytest.mark.pure
def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(cfgmod.InvalidConfig, match="file not found"):
        cfgmod.load(tmp_path / "nope.toml")


@pytest.mark.pure
def test_three_mistakes_get_three_errors(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
[agent]
intervall = 30          # typo
threshold = 0           # < 1
probe_timeout = "fast"  # wrong type
""",
    )
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(p)
    errs = {e.path: e.message for e in ei.value.errors}
    assert "did you mean 'interval'" in errs["agent.intervall"]
    assert errs["agent.threshold"].startswith("must be between 1 and 10000")
    assert "expected a duration" in errs["agent.probe_timeout"]
    assert len(ei.value.errors) == 3


@pytest.mark.pure
def test_cross_field_checks(tmp_path: Path) -> None:
    text = '[agent]\ninterval = "5s"\nprobe_timeout = "5s"\n[egress]\ndns_timeout = 6\n'
    p = write(tmp_path, text)
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(p)
    paths = [e.path for e in ei.value.errors]
    assert paths == ["agent.probe_timeout", "egress.dns_timeout"]


@pytest.mark.pure
def test_more_bad_values(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
[agnet]
x = 1
[egress]
targets = ["www.google.com", "1.2.3.4:99999"]
[metadata]
url = "ftp://x"
[agent]
action = "explode"
state_dir = "relative/dir"
""",
    )
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(p)
    msgs = [str(e) for e in ei.value.errors]
    assert any("agnet: unknown section (did you mean 'agent'?)" in m for m in msgs)
    assert any(m.startswith("egress.targets: not host:port") for m in msgs)
    assert any(m.startswith("metadata.url") for m in msgs)
    assert any(m.startswith("agent.action: must be one of") for m in msgs)
    assert any(m.startswith("agent.state_dir: must be an absolute path") for m in msgs)


@pytest.mark.pure
def test_bad_toml_is_reported(tmp_path: Path) -> None:
    with pytest.raises(cfgmod.InvalidConfig, match="not valid TOML"):
        cfgmod.load(write(tmp_path, "[agent\n"))


@pytest.mark.pure
@pytest.mark.parametrize(
    ("raw", "want"), [(30, 30.0), ("500ms", 0.5), ("10m", 600.0), ("2h", 7200.0), (1.5, 1.5)]
)
def test_durations(raw: object, want: float) -> None:
    assert parse_duration(raw) == want


@pytest.mark.pure
@pytest.mark.parametrize("raw", [True, "ten", "-1s", None])
def test_bad_durations(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(raw)


@pytest.mark.process
def test_config_check_cli_exit_codes(tmp_path: Path) -> None:
    bad = write(tmp_path, "[agent]\nthreshold = 0\ninterval = 1\nprobe_timeout = 2\n")
    r = gcewd("config", "check", str(bad))
    assert r.returncode == 78
    assert "agent.threshold: must be between 1 and 10000" in r.stderr
    assert "agent.probe_timeout: must be less than agent.interval" in r.stderr
    good = tmp_path / "good.toml"
    good.write_text("[agent]\ninterval = 10\n")
    r = gcewd("config", "check", str(good))
    assert r.returncode == 0 and "OK" in r.stdout


@pytest.mark.process
def test_run_refuses_invalid_config(tmp_path: Path) -> None:
    bad = write(tmp_path, "[agent]\nthreshold = -3\n")
    r = gcewd("run", "--config", str(bad))
    assert r.returncode == 78 and "agent.threshold" in r.stderr


@pytest.mark.pure
def test_every_key_is_documented() -> None:
    import dataclasses

    doc = (REPO / "docs" / "configuration.md").read_text()
    for sec in dataclasses.fields(cfgmod.Config):
        assert f"`[{sec.name}]`" in doc, sec.name
        for f in dataclasses.fields(getattr(cfgmod.Config(), sec.name)):
            assert f"| `{f.name}` |" in doc, f"{sec.name}.{f.name} missing in docs/configuration.md"
