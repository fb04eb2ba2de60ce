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
#
# Reproducible: every file's mtime is SOURCE_DATE_EPOCH (default: the last commit's time), owners
# are root; two builds of one tree give the same bytes. Needs root (chroot), dpkg-deb, and
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
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}"
prefix=/opt/gce-watchdog
broot="$("$here/debroot.sh" build "$release")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
stage="$work/root"
mkdir -p "$out"

# 1. The wheelhouse: pinned dependencies + the agent's wheel from this tree.
"$here/wheelhouse.sh" "$work/wh" 2>&1 | sed 's/^/  /' >&2
wh="$work/wh/wheelhouse"

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
rm -rf "$broot$prefix" "$broot/tmp/gcewd-wh"
flock -u 9
site="$(cd "$venv" && echo lib/python3.*/site-packages)"
rm -f "$venv/$site"/*.dist-info/direct_url.json
find "$venv" -name __pycache__ -prune -exec rm -rf {} +
# Python 3.13's venv writes a .gitignore: not part of an installed system.
rm -f "$venv/.gitignore"
# The dist-infos' RECORD files drop what was removed above (direct_url.json names a temp path).
"$py" - "$venv" <<'PY'
import csv, io, sys
from pathlib import Path
site = next(Path(sys.argv[1]).glob("lib/python3.*/site-packages"))
for record in site.glob("*.dist-info/RECORD"):
    rows = [r for r in csv.reader(record.read_text().splitlines())
            if r and (site / r[0]).resolve().exists()]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    record.write_text(buf.getvalue())
PY
if grep -rqI -e "$work" -e /tmp/gcewd-wh "$venv"; then
  echo "build-deb.sh: a build path is still in:" >&2; grep -rlI -e "$work" -e /tmp/gcewd-wh "$venv" >&2; exit 1
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
unit = stage / "lib/systemd/system" / UNIT
unit.parent.mkdir(parents=True)
cfg = cfgmod.load(conf)
unit.write_text(render_unit(template(UNIT), DEFAULT_EXEC, str(cfgmod.DEFAULT_PATH), cfg))
PY
install -D -m 0755 "$repo/startup/startup-script.sh" "$stage/usr/share/gce-watchdog/startup-script.sh"
install -d "$stage/usr/bin"
ln -s "$prefix/bin/gce-watchdog" "$stage/usr/bin/gce-watchdog"
doc="$stage/usr/share/doc/gce-watchdog"
install -D -m 0644 "$here/debian/copyright" "$doc/copyright"
# debian/changelog for this release, every version of packaging/debian/changes.toml.
"$py" "$here/changelog.py" "$here/debian/changes.toml" "$upstream" "$release" "$debver" |
  gzip -9n >"$doc/changelog.Debian.gz"
install -D -m 0644 "$here/debian/lintian-overrides" "$stage/usr/share/lintian/overrides/gce-watchdog"
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
install -d "$stage/DEBIAN"
for s in postinst prerm postrm; do install -m 0755 "$here/debian/$s" "$stage/DEBIAN/$s"; done
echo "/etc/gce-watchdog/config.toml" >"$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
# The venv's interpreter is this release's python3 X.Y: the package needs that minor version.
next="${pyver%.*}.$((${pyver#*.} + 1))"
sed "s/@VERSION@/$version/; s/@SIZE@/$size/; s/@PYMIN@/$pyver/; s/@PYNEXT@/$next/" \
  "$here/debian/control" >"$stage/DEBIAN/control"
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z |
  xargs -0 md5sum) >"$stage/DEBIAN/md5sums"

# 5. Normalize and build.
find "$stage" -type d -exec chmod 0755 {} +
chmod -R go-w "$stage"
find "$stage" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
deb="$out/gce-watchdog_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "build-deb.sh: $deb ($(du -k "$deb" | cut -f1) KiB, sha256 $(sha256sum "$deb" | cut -c1-16)...)" >&2
