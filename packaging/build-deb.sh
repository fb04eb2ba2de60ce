#!/usr/bin/env bash
# Build gce-watchdog_<version>_amd64.deb (docs/packaging.md): a self-contained venv under
# /opt/gce-watchdog made from Debian 12's /usr/bin/python3 and the wheelhouse (dependencies pinned
# by hash in packaging/requirements.lock, no index), the systemd unit, the default config (a
# conffile), the start-up script, copyright and changelog, and maintainer scripts that enable the
# unit always (an image bake) and start it only on a running system.
#
#   packaging/build-deb.sh OUTDIR        -> OUTDIR/gce-watchdog_<version>_amd64.deb
#
# Reproducible: every file's mtime is SOURCE_DATE_EPOCH (default: the last commit's time), owners
# are root, the paths of the build directory are rewritten out of the venv; two builds of one
# tree give the same bytes. Needs dpkg-deb and /usr/bin/python3 3.11 (Debian 12); no root.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="${1:?usage: build-deb.sh OUTDIR}"
py="$repo/.venv/bin/python"
[ -x "$py" ] || { echo "build-deb.sh: run make venv first ($py missing)" >&2; exit 1; }
target_py=/usr/bin/python3
"$target_py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "build-deb.sh: $target_py is not Python 3.11 (the lock and the package are for Debian 12)" >&2
  exit 1; }
version="$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$repo/pyproject.toml")"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}"
prefix=/opt/gce-watchdog
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
stage="$work/root"
mkdir -p "$out"

# 1. The wheelhouse: pinned dependencies + the agent's wheel from this tree.
"$here/wheelhouse.sh" "$work/wh" 2>&1 | sed 's/^/  /' >&2
wh="$work/wh/wheelhouse"

# 2. The venv, built at its final path inside the stage, then its build paths rewritten.
venv="$stage$prefix"
"$target_py" -m venv --without-pip "$venv"
pip=("$py" -m pip --isolated --python "$venv/bin/python" install -q --disable-pip-version-check --no-index
  --no-compile --find-links "$wh")
"${pip[@]}" --require-hashes --only-binary=:all: -r "$wh/requirements.lock"
"${pip[@]}" --no-deps "$wh"/gce_watchdog-*.whl
rm -f "$venv"/lib/python3.11/site-packages/*.dist-info/direct_url.json
find "$venv" -name __pycache__ -prune -exec rm -rf {} +
# Shebangs and activate scripts name the stage; pyvenv.cfg names the build command.
grep -rlI --null -- "$stage" "$venv/bin" | xargs -0 -r sed -i "s#$stage$prefix#$prefix#g"
sed -i "s#^command = .*#command = $target_py -m venv --without-pip $prefix#" "$venv/pyvenv.cfg"
# The rewritten scripts' hashes in the dist-infos' RECORD files follow (pip checks them on
# uninstall; and a build-path-dependent hash would make two builds differ).
"$py" - "$venv" <<'PY'
import base64, csv, hashlib, io, sys
from pathlib import Path
site = next(Path(sys.argv[1]).glob("lib/python3.*/site-packages"))
for record in site.glob("*.dist-info/RECORD"):
    rows = list(csv.reader(record.read_text().splitlines()))
    # Files removed above (direct_url.json: the build's temp path) leave the RECORD too.
    rows = [r for r in rows if r and (site / r[0]).resolve().exists()]
    for row in rows:
        f = (site / row[0]).resolve() if row and row[0] else None
        if f is not None and f.parent.name == "bin" and f.is_file() and len(row) == 3 and row[1]:
            data = f.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            row[1], row[2] = f"sha256={digest}", str(len(data))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    record.write_text(buf.getvalue())
PY
if grep -rqI -- "$work" "$venv"; then
  echo "build-deb.sh: the build path is still in:" >&2; grep -rlI -- "$work" "$venv" >&2; exit 1
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
install -D -m 0644 "$repo/systemd/gce-watchdog-poller.service" "$stage/lib/systemd/system/gce-watchdog-poller.service"
install -D -m 0755 "$repo/startup/startup-script.sh" "$stage/usr/share/gce-watchdog/startup-script.sh"
install -d "$stage/usr/bin"
ln -s "$prefix/bin/gce-watchdog" "$stage/usr/bin/gce-watchdog"
doc="$stage/usr/share/doc/gce-watchdog"
install -D -m 0644 "$here/debian/copyright" "$doc/copyright"
sed "s/@VERSION@/$version/; s/@DATE@/$(date -u -R -d "@$SOURCE_DATE_EPOCH")/" "$here/debian/changelog" |
  gzip -9n >"$doc/changelog.gz"
install -D -m 0644 "$here/debian/lintian-overrides" "$stage/usr/share/lintian/overrides/gce-watchdog"
# The man page and shell completions `make cli-docs` generates (GCEWD_CLI_DOCS, default
# build/cli-docs; `make deb` runs it first). Absent: the package goes without them.
docs="${GCEWD_CLI_DOCS:-$repo/build/cli-docs}"
if [ -f "$docs/man1/gce-watchdog.1" ]; then
  install -D -m 0644 "$docs/man1/gce-watchdog.1" "$stage/usr/share/man/man1/gce-watchdog.1"
  gzip -9n "$stage/usr/share/man/man1/gce-watchdog.1"
fi
[ ! -f "$docs/bash-completion/gce-watchdog" ] || install -D -m 0644 \
  "$docs/bash-completion/gce-watchdog" "$stage/usr/share/bash-completion/completions/gce-watchdog"
[ ! -f "$docs/zsh/_gce-watchdog" ] || install -D -m 0644 \
  "$docs/zsh/_gce-watchdog" "$stage/usr/share/zsh/vendor-completions/_gce-watchdog"

# 4. Control files.
install -d "$stage/DEBIAN"
for s in postinst prerm postrm; do install -m 0755 "$here/debian/$s" "$stage/DEBIAN/$s"; done
echo "/etc/gce-watchdog/config.toml" >"$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
sed "s/@VERSION@/$version/; s/@SIZE@/$size/" "$here/debian/control" >"$stage/DEBIAN/control"
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z |
  xargs -0 md5sum) >"$stage/DEBIAN/md5sums"

# 5. Normalize and build.
find "$stage" -type d -exec chmod 0755 {} +
chmod -R go-w "$stage"
find "$stage" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
deb="$out/gce-watchdog_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "build-deb.sh: $deb ($(du -k "$deb" | cut -f1) KiB, sha256 $(sha256sum "$deb" | cut -c1-16)...)" >&2
