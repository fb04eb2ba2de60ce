"""Config drop-ins: config.toml then config.d/*.toml in byte order, merged per key inside
sections; where each value came from; hostile entries in config.d/ are refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from gce_watchdog.vm import config as cfgmod
from hypothesis import given
from hypothesis import strategies as st
from kit.nobody import Nobody


def _tree(tmp: Path, main: str | None = "", **dropins: str) -> Path:
    """tmp/config.toml (None: absent) and tmp/config.d/<name> for each keyword (``_`` in a name
    stands for ``-``, ``__`` for ``.``)."""
    cfg = tmp / "config.toml"
    if main is not None:
        cfg.write_text(main)
    d = tmp / "config.d"
    d.mkdir(exist_ok=True)
    for name, text in dropins.items():
        (d / name.replace("__", ".").replace("_", "-")).write_text(text)
    return cfg


def _gw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gce_watchdog", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.pure
def test_later_files_replace_single_keys_and_keep_the_rest(tmp_path: Path) -> None:
    cfg = _tree(
        tmp_path,
        '[agent]\ninterval = "10s"\nthreshold = 3\n[egress]\ntargets = ["a.example:443"]\n',
        a10_a__toml='[agent]\nthreshold = 5\n[egress]\ntargets = ["b.example:443"]\n',
        a50_metadata__toml="[agent]\nthreshold = 7\n[memory]\nenabled = false\n",
    )
    d = tmp_path / "config.d"
    for f in d.iterdir():  # the keyword trick made "a10-a.toml": name them as operators do
        f.rename(d / f.name[1:])
    got = cfgmod.load_sources(cfg)
    c = got.config
    assert c.agent.interval == 10.0  # only in config.toml
    assert c.agent.threshold == 7  # 50-metadata.toml is read after 10-a.toml
    assert c.egress.targets == ["b.example:443"]  # a list is replaced, never appended to
    assert c.memory.enabled is False
    assert got.files == (str(cfg), str(d / "10-a.toml"), str(d / "50-metadata.toml"))
    assert got.source_of("agent.interval") == str(cfg)
    assert got.source_of("agent.threshold") == str(d / "50-metadata.toml")
    assert got.source_of("egress.targets") == str(d / "10-a.toml")
    assert got.source_of("agent.probe_timeout") == "default"
    assert cfgmod.load(cfg) == c


@pytest.mark.pure
def test_order_is_byte_order_of_the_names(tmp_path: Path) -> None:
    d = tmp_path / "config.d"
    d.mkdir()
    for name, thr in (("9-z.toml", 9), ("10-a.toml", 10), ("50-m.toml", 50), ("A.toml", 65)):
        (d / name).write_text(f"[agent]\nthreshold = {thr}\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text("")
    got = cfgmod.load_sources(cfg)
    assert [Path(f).name for f in got.files[1:]] == ["10-a.toml", "50-m.toml", "9-z.toml", "A.toml"]
    assert got.config.agent.threshold == 65


@pytest.mark.pure
@given(layers=st.lists(st.one_of(st.none(), st.integers(1, 10_000)), min_size=1, max_size=6))
def test_the_last_file_that_sets_a_key_wins(
    tmp_path_factory: pytest.TempPathFactory, layers: list[int | None]
) -> None:
    tmp = tmp_path_factory.mktemp("layers")
    d = tmp / "config.d"
    d.mkdir()
    (tmp / "config.toml").write_text("[agent]\nheartbeat_every = 2\n")
    for i, thr in enumerate(layers):
        body = f"threshold = {thr}\n" if thr is not None else ""
        (d / f"{i:02d}-x.toml").write_text("[agent]\n" + body)
    got = cfgmod.load_sources(tmp / "config.toml")
    set_by = [(i, t) for i, t in enumerate(layers) if t is not None]
    want = set_by[-1][1] if set_by else 10
    assert got.config.agent.threshold == want
    assert got.config.agent.heartbeat_every == 2
    src = str(d / f"{set_by[-1][0]:02d}-x.toml") if set_by else "default"
    assert got.source_of("agent.threshold") == src


@pytest.mark.pure
def test_errors_of_every_file_at_once_each_named_with_its_file(tmp_path: Path) -> None:
    cfg = _tree(
        tmp_path,
        "[agent]\nthreshold = 0\n",
        a__toml="[agent]\nintervall = 3\n",
        b__toml="[agent\n",
        c__toml="[memory]\nenabled = 1\n",
    )
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(cfg)
    d = tmp_path / "config.d"
    got = {(e.source, e.path) for e in ei.value.errors}
    assert (str(cfg), "agent.threshold") in got
    assert (str(d / "a.toml"), "agent.intervall") in got
    assert (str(d / "c.toml"), "memory.enabled") in got
    assert any(
        e.path == str(d / "b.toml") and "not valid TOML" in e.message for e in ei.value.errors
    )
    assert len(ei.value.errors) == 4
    assert f"{d / 'a.toml'}: agent.intervall: unknown key (did you mean 'interval'?)" in str(
        ei.value
    )


@pytest.mark.pure
def test_cross_field_rules_run_on_the_merged_result(tmp_path: Path) -> None:
    # Alone each file is fine; together the probe timeout is longer than the interval.
    cfg = _tree(tmp_path, '[agent]\ninterval = "10s"\n', x__toml='[agent]\nprobe_timeout = "20s"\n')
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(cfg)
    (e,) = ei.value.errors
    assert e.path == "agent.probe_timeout" and e.source == str(tmp_path / "config.d/x.toml")
    assert "must be less than agent.interval (20s >= 10s)" in e.message
    # ... and a drop-in can repair what the file alone gets wrong
    (tmp_path / "config.d/y.toml").write_text('[agent]\ninterval = "30s"\n')
    assert cfgmod.load(cfg).agent.probe_timeout == 20.0


@pytest.mark.process
def test_what_is_not_read_is_said_never_silently_half_read(tmp_path: Path) -> None:
    cfg = _tree(
        tmp_path,
        "",
        README="threshold = x\n",
        a50_x__toml__dpkg_old="[agent]\nthreshold = 2\n",
        a__toml_="[agent]\nthreshold = 3\n",
    )
    d = tmp_path / "config.d"
    (d / ".50-metadata.toml.tmp").write_text("[agent]\nthreshold = 4\n")  # an atomic write's temp
    (d / "a50-x.toml.dpkg-old").rename(d / "50-x.toml.dpkg-old")
    got = cfgmod.load_sources(cfg)
    assert got.config.agent.threshold == 10 and got.files == (str(cfg),)
    assert sorted(Path(p).name for p, _ in got.ignored) == [
        "50-x.toml.dpkg-old",
        "README",
        "a.toml-",
    ]
    chk = _gw("config", "check", str(cfg))
    assert chk.returncode == 0
    assert f"note: {d / 'README'}: not a *.toml name: not read" in chk.stderr
    assert ".50-metadata" not in chk.stderr


@pytest.mark.process
def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, "")
    os.mkfifo(tmp_path / "config.d/50-pipe.toml")  # no writer: a blocking open would hang
    chk = _gw("config", "check", str(cfg))
    assert chk.returncode == 78
    assert "50-pipe.toml: is a FIFO (named pipe), not a regular file: refused" in chk.stderr


@pytest.mark.pure
def test_symlinks_are_followed_to_regular_files_only(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, "")
    d = tmp_path / "config.d"
    target = tmp_path / "elsewhere.toml"
    target.write_text("[agent]\nthreshold = 4\n")
    (d / "40-link.toml").symlink_to(target)
    got = cfgmod.load_sources(cfg)
    assert got.config.agent.threshold == 4
    assert got.source_of("agent.threshold") == str(d / "40-link.toml")  # the name in config.d
    (d / "41-zero.toml").symlink_to("/dev/zero")
    (d / "42-gone.toml").symlink_to(tmp_path / "missing.toml")
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(cfg)
    msgs = [str(e) for e in ei.value.errors]
    assert any("41-zero.toml: is a character device" in m for m in msgs), msgs
    assert any("42-gone.toml: a dangling symlink" in m for m in msgs), msgs
    assert len(msgs) == 2


@pytest.mark.pure
def test_world_writable_drop_ins_and_directory_are_refused(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, "", a__toml="[agent]\nthreshold = 4\n")
    f = tmp_path / "config.d/a.toml"
    f.chmod(0o666)
    with pytest.raises(cfgmod.InvalidConfig, match=r"a.toml: world-writable \(mode 0666\)"):
        cfgmod.load(cfg)
    f.chmod(0o644)
    assert cfgmod.load(cfg).agent.threshold == 4
    (tmp_path / "config.d").chmod(0o1777)  # sticky or not: anyone may add a file
    try:
        with pytest.raises(cfgmod.InvalidConfig, match=r"config.d: world-writable \(mode 1777\)"):
            cfgmod.load(cfg)
    finally:
        (tmp_path / "config.d").chmod(0o755)


@pytest.mark.pure
def test_a_directory_or_a_file_in_the_wrong_place_is_refused(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, "")
    (tmp_path / "config.d/50-dir.toml").mkdir()
    with pytest.raises(cfgmod.InvalidConfig, match=r"50-dir\.toml: is a directory"):
        cfgmod.load(cfg)
    (tmp_path / "config.d/50-dir.toml").rmdir()
    (tmp_path / "config.d").rmdir()
    (tmp_path / "config.d").write_text("[agent]\n")
    with pytest.raises(cfgmod.InvalidConfig, match=r"config\.d: is not a directory"):
        cfgmod.load(cfg)


@pytest.mark.process
def test_an_unreadable_drop_in_is_an_error(nobody: Nobody, nobody_dir: Path) -> None:
    # As root every file is readable: read as nobody (setpriv) to get EACCES. The tree is a 0755
    # directory of its own under /tmp (pytest's tmp dirs are 0700), and nobody imports the agent
    # from a world-readable copy (kit/nobody.py): a checkout under `mktemp -d` is 0700 too.
    tmp = nobody_dir
    cfg = _tree(tmp, "", a__toml="[agent]\nthreshold = 4\n")
    cfg.chmod(0o644)
    (tmp / "config.d").chmod(0o755)
    (tmp / "config.d/a.toml").chmod(0o600)
    code = (
        "import sys\nfrom gce_watchdog.vm import config as c\n"
        "try:\n  c.load(sys.argv[1])\nexcept c.InvalidConfig as e:\n  print(e); sys.exit(78)"
    )
    r = nobody.run(["-c", code, str(cfg)])
    assert r.returncode == 78, r.stdout + r.stderr
    assert "a.toml: cannot read: Permission denied" in r.stdout


@pytest.mark.process
def test_config_show_names_the_source_of_every_key_and_still_parses(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, '[agent]\ninterval = "10s"\n', a50_md__toml="[agent]\nthreshold = 5\n")
    (tmp_path / "config.d/a50-md.toml").rename(tmp_path / "config.d/50-md.toml")
    shown = _gw("config", "show", "--config", str(cfg))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f'interval = "10s"  # {cfg}' in lines
    assert f"threshold = 5  # {tmp_path / 'config.d/50-md.toml'}" in lines
    assert 'probe_timeout = "5s"  # default' in lines
    keyed = [ln for ln in lines if ln and not ln.startswith("[")]
    assert all("  # " in ln for ln in keyed)  # every key says where it came from
    assert cfgmod.from_dict(tomllib.loads(shown.stdout)) == cfgmod.load(cfg)
    bare = _gw("config", "show", "--no-sources", "--config", str(cfg))
    assert "#" not in bare.stdout and tomllib.loads(bare.stdout) == tomllib.loads(shown.stdout)


@pytest.mark.process
def test_config_check_drop_in_checks_the_merge_as_if_it_were_installed(tmp_path: Path) -> None:
    cfg = _tree(tmp_path, '[agent]\ninterval = "10s"\n', a__toml="[agent]\nthreshold = 0\n")
    (tmp_path / "config.d/a.toml").rename(tmp_path / "config.d/50-metadata.toml")
    new = tmp_path / "new" / "50-metadata.toml"
    new.parent.mkdir()
    new.write_text("[agent]\nthreshold = 3\n")
    # the installed 50-metadata.toml (threshold 0) is replaced by the candidate of that name
    ok = _gw("config", "check", "--config", str(cfg), "--drop-in", str(new))
    assert ok.returncode == 0, ok.stderr
    assert "with 1 drop-in(s): OK" in ok.stdout
    new.write_text('[agent]\nprobe_timeout = "15s"\n')  # fine alone, not with interval = 10s
    bad = _gw("config", "check", "--config", str(cfg), "--drop-in", str(new))
    assert bad.returncode == 78
    assert f"{new}: agent.probe_timeout: must be less than agent.interval" in bad.stderr
    assert _gw("config", "check", "--config", str(cfg)).returncode == 78  # threshold 0


@pytest.mark.pure
def test_without_drop_ins_messages_are_as_before(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[agent]\nthreshold = 0\n")
    with pytest.raises(cfgmod.InvalidConfig) as ei:
        cfgmod.load(cfg)
    assert str(ei.value).startswith(f"{cfg}: 1 configuration error(s):\n  - agent.threshold:")
