#!/usr/bin/env bash
# Build gce-watchdog_<version>-1~debNNu1_amd64.deb for one Debian release (docs/packaging.md): a
# self-contained venv under /opt/gce-watchdog made inside a debootstrap tree of that release
# (packaging/debroot.sh, cached under build/) with the release's own /usr/bin/python3 and pip,
# filled from the wheelhouse (dependencies pinned by hash in packaging/requirements.lock, no
# index); the systemd unit, the default config (a conffile), the start-up script, copyright, a
# changelog rendered for that release from packaging/debian/changes.toml, man pages, and
# maintainer scripts that enable the unit always (an image bake) and start it only on a running
# system.
#
#   packaging/build-deb.sh OUTDIR [RELEASE]   RELEASE: bookworm (default, Debian 12) or trixie
#       -> OUTDIR/gce-watchdog_<version>_amd64.deb, e.g. gce-watchdog_0.1.0-1~deb12u1_amd64.deb
#          OUTDIR/gce-watchdog-poller_<version>_amd64.deb: the poller's unit and the libraries
#          its PostgreSQL ledger and Pub/Sub need (packaging/requirements-deb-poller.lock), added
#          to the agent's venv (docs/packaging.md, "Two packages")
#
# Reproducible: every file's mtime is SOURCE_DATE_EPOCH (default: the date of the newest
# changelog entry, as dpkg-buildpackage takes it), owners are root; two builds of one tree give
# the same bytes, on any day. Needs root (chroot), dpkg-deb, and
# debootstrap plus Debian's archive the first time a release's build root is made.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="${1:?usage: build-deb.sh OUTDIR [bookworm|trixie]}"
release="${2:-bookworm}"
case "$release" in
bookworm) debver=12 ;;
trixie) debver=13 ;;
*) echo "build-deb.sh: unknown release '$release' (bookworm or trixie)" >&2; exit 64 ;;
esac
py="$repo/.venv/bin/python"
[ -x "$py" ] || { echo "build-deb.sh: run make venv first ($py missing)" >&2; exit 1; }
upstream="$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$repo/pyproject.toml")"
# Debian revision 1, then the release: ~deb12u1 sorts before ~deb13u1, and both before a plain
# -1, so a dist-upgrade from 12 to 13 with both in one repository takes the Debian 13 build.
version="$upstream-1~deb${debver}u1"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$("$py" "$here/changelog.py" --epoch "$here/debian/changes.toml")}"
prefix=/opt/gce-watchdog
broot="$("$here/debroot.sh" build "$release")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
stage="$work/root"
mkdir -p "$out"

# 1. The wheelhouse: pinned dependencies + the agent's wheel from this tree.
"$here/wheelhouse.sh" "$work/wh" 2>&1 | sed 's/^/  /' >&2
wh="$work/wh/wheelhouse"
# ...and the poller package's: what requirements-deb-poller.lock adds (downloaded once, checked
# against the lock's hashes, cached by the lock's own hash).
plock="$here/requirements-deb-poller.lock"
pcache="${GCEWD_POLLER_WHEEL_CACHE:-$repo/build/cache/wheels-poller-$(sha256sum "$plock" | cut -c1-16)}"
mkdir -p "$(dirname "$pcache")"
exec 6>"$pcache.lock"
flock 6
if [ ! -s "$pcache/.complete" ]; then
  rm -rf "$pcache" && mkdir -p "$pcache"
  read -ra ppy <<<"$(sed -n 's/^# python: //p' "$plock")"
  for v in "${ppy[@]}"; do
    "$py" -m pip download -q --disable-pip-version-check --dest "$pcache" --no-deps --require-hashes \
      --only-binary=:all: --implementation cp --python-version "$v" --abi "cp${v//./}" --abi abi3 \
      --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform any -r "$plock" >"$pcache.log" 2>&1 || {
        cat "$pcache.log" >&2; exit 1; }
  done
  cp "$plock" "$pcache/.complete"
fi
flock -u 6
cp "$pcache"/*.whl "$wh/" && cp "$plock" "$wh/"

# 2. The venv, made at its final path inside the build root with the release's own python3 (its
#    pip installs into it with --python; the installed venv has no pip). One build at a time per
#    build root.
exec 9>"$broot.lock"
flock 9
pyver="$(chroot "$broot" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
grep -q "^# python:.* $pyver\b" <(sed 's/$/ /' "$wh/requirements.lock") || {
  echo "build-deb.sh: $release's python3 is $pyver; requirements.lock has no wheels for it (packaging/lock.sh)" >&2
  exit 1; }
rm -rf "$broot$prefix" "$broot/tmp/gcewd-wh" && cp -r "$wh" "$broot/tmp/gcewd-wh"
inch=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 chroot "$broot")
"${inch[@]}" /usr/bin/python3 -m venv --without-pip "$prefix"
pip=(/usr/bin/python3 -m pip --isolated --python "$prefix/bin/python" install -q
  --disable-pip-version-check --no-index --no-compile --find-links /tmp/gcewd-wh)
"${inch[@]}" "${pip[@]}" --require-hashes --only-binary=:all: -r /tmp/gcewd-wh/requirements.lock
agent_whl="$(basename "$(compgen -G "$wh/gce_watchdog-*.whl")")"
"${inch[@]}" "${pip[@]}" --no-deps "/tmp/gcewd-wh/$agent_whl"
venv="$stage$prefix"
mkdir -p "$stage/opt"
cp -a "$broot$prefix" "$venv"
# The poller package: the same venv plus requirements-deb-poller.lock (installed together with
# requirements.lock, whose distributions are there already); it ships only the files that adds.
"${inch[@]}" "${pip[@]}" --require-hashes --only-binary=:all: -r /tmp/gcewd-wh/requirements.lock \
  -r /tmp/gcewd-wh/requirements-deb-poller.lock
pstage="$work/poller"
mkdir -p "$pstage/opt"
cp -a "$broot$prefix" "$pstage$prefix"
rm -rf "$broot$prefix" "$broot/tmp/gcewd-wh"
flock -u 9
site="$(cd "$venv" && echo lib/python3.*/site-packages)"
for v in "$venv" "$pstage$prefix"; do
  rm -f "$v/$site"/*.dist-info/direct_url.json
  find "$v" -name __pycache__ -prune -exec rm -rf {} +
  # Python 3.13's venv writes a .gitignore: not part of an installed system.
  rm -f "$v/.gitignore"
done
# The poller package keeps what the agent's has not; a file of the agent's that the second
# install changed would be two packages' file: refused.
"$py" - "$venv" "$pstage$prefix" <<'PY'
import filecmp, os, sys
from pathlib import Path
agent, poller = Path(sys.argv[1]), Path(sys.argv[2])
for dirpath, dirnames, filenames in os.walk(poller, topdown=False):
    d = Path(dirpath)
    for name in filenames:
        f = d / name
        twin = agent / f.relative_to(poller)
        if not os.path.lexists(twin):
            continue
        if f.is_symlink() or twin.is_symlink():
            same = f.is_symlink() and twin.is_symlink() and os.readlink(f) == os.readlink(twin)
        else:
            same = filecmp.cmp(f, twin, shallow=False)
        if not same:
            sys.exit(f"build-deb.sh: the poller's install changed the agent's {twin}")
        f.unlink()
    for name in dirnames:
        sub = d / name
        twin = agent / sub.relative_to(poller)
        if sub.is_symlink():  # lib64 -> lib: the agent's
            if not (twin.is_symlink() and os.readlink(sub) == os.readlink(twin)):
                sys.exit(f"build-deb.sh: the poller's install changed the agent's {twin}")
            sub.unlink()
        elif not any(sub.iterdir()):
            sub.rmdir()
PY
# The dist-infos' RECORD files drop what was removed above (direct_url.json names a temp path).
"$py" - "$venv" "$pstage$prefix" <<'PY'
import csv, io, sys
from pathlib import Path
for root in sys.argv[1:]:
    site = next(Path(root).glob("lib/python3.*/site-packages"), None)
    if site is None:
        continue
    for record in site.glob("*.dist-info/RECORD"):
        rows = [r for r in csv.reader(record.read_text().splitlines())
                if r and (site / r[0]).resolve().exists()]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        record.write_text(buf.getvalue())
PY
if grep -rqI -e "$work" -e /tmp/gcewd-wh "$venv" "$pstage$prefix"; then
  echo "build-deb.sh: a build path is still in:" >&2
  grep -rlI -e "$work" -e /tmp/gcewd-wh "$venv" "$pstage$prefix" >&2; exit 1
fi

# 3. The unit (ExecStart= the venv's agent), the default config, the start-up script, docs.
"$py" - "$stage" <<'PY'
import sys
from pathlib import Path
from gce_watchdog.bootstrap.install import DEFAULT_EXEC, UNIT, render_unit, template
from gce_watchdog.vm import config as cfgmod

stage = Path(sys.argv[1])
conf = stage / str(cfgmod.DEFAULT_PATH).lstrip("/")
conf.parent.mkdir(parents=True)
conf.write_text(template("config.toml"))
unit = stage / "usr/lib/systemd/system" / UNIT
unit.parent.mkdir(parents=True)
cfg = cfgmod.load(conf)
unit.write_text(render_unit(template(UNIT), DEFAULT_EXEC, str(cfgmod.DEFAULT_PATH), cfg))
PY
# Units under /usr/lib/systemd/system (not the aliased /lib: dpkg does not know the two are one
# directory on a merged-/usr system, Debian 12 and 13 alike).
install -D -m 0644 "$repo/systemd/gce-watchdog-poller.service" "$pstage/usr/lib/systemd/system/gce-watchdog-poller.service"
install -D -m 0755 "$repo/startup/startup-script.sh" "$stage/usr/share/gce-watchdog/startup-script.sh"
install -d "$stage/usr/bin"
ln -s "$prefix/bin/gce-watchdog" "$stage/usr/bin/gce-watchdog"
doc="$stage/usr/share/doc/gce-watchdog"
install -D -m 0644 "$here/debian/copyright" "$doc/copyright"
# debian/changelog for this release, every version of packaging/debian/changes.toml.
"$py" "$here/changelog.py" "$here/debian/changes.toml" "$upstream" "$release" "$debver" |
  gzip -9n >"$doc/changelog.Debian.gz"
install -D -m 0644 "$here/debian/lintian-overrides" "$stage/usr/share/lintian/overrides/gce-watchdog"
pdoc="$pstage/usr/share/doc/gce-watchdog-poller"
install -D -m 0644 "$here/debian/copyright" "$pdoc/copyright"
"$py" "$here/changelog.py" "$here/debian/changes.toml" "$upstream" "$release" "$debver" |
  sed '/^gce-watchdog (/s/^gce-watchdog /gce-watchdog-poller /' | gzip -9n >"$pdoc/changelog.Debian.gz"
install -D -m 0644 "$here/debian/poller.lintian-overrides" "$pstage/usr/share/lintian/overrides/gce-watchdog-poller"
# The man pages and shell completions `make cli-docs` generates (GCEWD_CLI_DOCS, default
# build/cli-docs; `make deb` runs it first). Absent: the package goes without them.
docs="${GCEWD_CLI_DOCS:-$repo/build/cli-docs}"
for page in man1/gce-watchdog.1 man5/gce-watchdog.toml.5; do
  [ -f "$docs/$page" ] || continue
  install -D -m 0644 "$docs/$page" "$stage/usr/share/man/$page"
  gzip -9n "$stage/usr/share/man/$page"
done
[ ! -f "$docs/bash-completion/gce-watchdog" ] || install -D -m 0644 \
  "$docs/bash-completion/gce-watchdog" "$stage/usr/share/bash-completion/completions/gce-watchdog"
[ ! -f "$docs/zsh/_gce-watchdog" ] || install -D -m 0644 \
  "$docs/zsh/_gce-watchdog" "$stage/usr/share/zsh/vendor-completions/_gce-watchdog"

# 4. Control files.
install -d "$stage/DEBIAN" "$pstage/DEBIAN"
for s in postinst prerm postrm; do
  install -m 0755 "$here/debian/$s" "$stage/DEBIAN/$s"
  install -m 0755 "$here/debian/poller.$s" "$pstage/DEBIAN/$s"
done
echo "/etc/gce-watchdog/config.toml" >"$stage/DEBIAN/conffiles"
# The venv's interpreter is this release's python3 X.Y: the package needs that minor version.
next="${pyver%.*}.$((${pyver#*.} + 1))"
for pair in "$stage:control" "$pstage:poller.control"; do
  st="${pair%%:*}"
  size=$(du -sk --exclude=DEBIAN "$st" | cut -f1)
  sed "s/@VERSION@/$version/g; s/@SIZE@/$size/; s/@PYMIN@/$pyver/; s/@PYNEXT@/$next/" \
    "$here/debian/${pair#*:}" >"$st/DEBIAN/control"
  (cd "$st" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z |
    xargs -0 md5sum) >"$st/DEBIAN/md5sums"
done

# 5. Normalize and build.
for pair in "$stage:gce-watchdog" "$pstage:gce-watchdog-poller"; do
  st="${pair%%:*}"
  find "$st" -type d -exec chmod 0755 {} +
  chmod -R go-w "$st"
  # Shared libraries the wheels bundle (psycopg_binary.libs/*.so.N) come 0755: not executables.
  find "$st" -type f -name '*.so*' -exec chmod 0644 {} +
  find "$st" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  deb="$out/${pair#*:}_${version}_amd64.deb"
  dpkg-deb --root-owner-group -Zxz --build "$st" "$deb" >/dev/null
  echo "build-deb.sh: $deb ($(du -k "$deb" | cut -f1) KiB, sha256 $(sha256sum "$deb" | cut -c1-16)...)" >&2
done
