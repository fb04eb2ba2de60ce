"""The [memory] config section: defaults, per-key checks, cross-field checks, all at once."""

from __future__ import annotations

import tomllib

import pytest
from gce_watchdog.vm import config as cfgmod

pytestmark = pytest.mark.pure


def test_defaults_report_only() -> None:
    m = cfgmod.Config().memory
    assert m.enabled and m.gpu
    assert (m.period, m.warmup, m.window, m.max_window) == (30.0, 300.0, 30, 240)
    assert (m.band_gib, m.alpha, m.serial_every) == (1.0, 0.01, 600.0)
    assert m.on_climb == "report" and m.climb_command == []


def test_durations_and_values_parse() -> None:
    cfg = cfgmod.from_dict(
        {
            "memory": {
                "period": "10s",
                "warmup": "2m",
                "window": 60,
                "max_window": 360,
                "band_gib": 0.5,
                "on_climb": "command",
                "climb_command": ["/usr/local/bin/dump-mem", "--all"],
            }
        }
    )
    assert cfg.memory.period == 10.0 and cfg.memory.warmup == 120.0
    assert cfg.memory.climb_command == ["/usr/local/bin/dump-mem", "--all"]


@pytest.mark.parametrize(
    ("written", "gib"),
    [(0.5, 0.5), (2, 2.0), ("512MiB", 0.5), ("1.5GiB", 1.5), ("1GB", 1e9 / 2**30)],
)
def test_band_takes_a_size_with_its_unit_or_gib_as_a_number(written: object, gib: float) -> None:
    """The one size parser (lib/sizes) for the config key too; a bare number stays GiB."""
    cfg = cfgmod.from_dict({"memory": {"band_gib": written}})
    assert cfg.memory.band_gib == pytest.approx(gib)
    # config show writes it back in a form config check reads to the same value
    back = cfgmod.from_dict(tomllib.loads(cfgmod.to_toml(cfg)))
    assert back.memory.band_gib == pytest.approx(gib)


@pytest.mark.parametrize(
    ("written", "why"),
    [("1.5", "needs a unit"), ("1.5 parsecs", "expected a size"), (True, "size")],
)
def test_band_refuses_a_string_without_a_unit(written: object, why: str) -> None:
    with pytest.raises(cfgmod.InvalidConfig) as e:
        cfgmod.from_dict({"memory": {"band_gib": written}})
    assert "memory.band_gib" in str(e.value) and why in str(e.value)


def test_every_error_at_once() -> None:
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.from_dict(
            {
                "memory": {
                    "window": 12,
                    "alpha": 0.9,
                    "band_gib": 0,
                    "on_climb": "reboot",
                    "perod": "30s",
                }
            }
        )
    text = str(ei.value)
    assert "memory.window: must be >= 30" in text
    assert "memory.alpha: must be in (0, 0.5)" in text
    assert "memory.band_gib: must be in (0, 1e6]" in text
    assert "memory.on_climb: must be one of report, command" in text
    assert "did you mean 'period'" in text


def test_cross_checks() -> None:
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.from_dict({"memory": {"window": 60, "max_window": 40, "on_climb": "command"}})
    text = str(ei.value)
    assert "memory.max_window: must be >= memory.window (40 < 60)" in text
    assert "memory.climb_command: on_climb = 'command' needs an argv list" in text
