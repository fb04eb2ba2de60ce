#!/bin/bash
# bake-image.sh: pre-install the gce-watchdog agent (and its systemd unit) into a VM image, so the
# start-up script finds it under /opt/gce-watchdog and downloads nothing at boot.
#
# Run as root on the image-build VM (Packer, or a VM you then turn into an image):
#   bake-image.sh --wheelhouse DIR      # offline: DIR holds gce-watchdog and all its dependencies
#   bake-image.sh --wheel FILE.whl      # dependencies from the package index
#   bake-image.sh --spec 'gce-watchdog==0.1.0'   # everything from the package index (default)
# Options: --prefix DIR (default $GCEWD_ROOT/opt/gce-watchdog), --python PY (default python3),
#          --no-unit (do not run `gce-watchdog install`), --startup-script (also copy the start-up
#          script to PREFIX/share/startup-script.sh for a `startup-script-url`-less setup).
# Exit codes: 0 ok, 64 bad arguments, 1 the install failed (pip's message is above).
set -Eeuo pipefail
umask 022

ROOT="${GCEWD_ROOT:-}"
PREFIX="${GCEWD_PREFIX:-$ROOT/opt/gce-watchdog}"
PYTHON="${GCEWD_PYTHON:-python3}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mode=spec spec=gce-watchdog src="" unit=1 copy_script=0

usage() {
	sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
	exit 64
}

while (($#)); do
	case "$1" in
	--wheelhouse) mode=wheelhouse src=${2:?--wheelhouse needs a directory} && shift ;;
	--wheel) mode=wheel src=${2:?--wheel needs a file} && shift ;;
	--spec) mode=spec spec=${2:?--spec needs a requirement} && shift ;;
	--prefix) PREFIX=${2:?--prefix needs a directory} && shift ;;
	--python) PYTHON=${2:?--python needs an interpreter} && shift ;;
	--no-unit) unit=0 ;;
	--startup-script) copy_script=1 ;;
	-h | --help) usage ;;
	*)
		echo "bake-image.sh: unknown argument '$1'" >&2
		usage
		;;
	esac
	shift
done

case $mode in
wheelhouse) [[ -d $src ]] || { echo "bake-image.sh: $src is not a directory" >&2 && exit 64; } ;;
wheel) [[ -f $src ]] || { echo "bake-image.sh: $src is not a file" >&2 && exit 64; } ;;
*) ;;
esac

echo "bake-image.sh: installing gce-watchdog into $PREFIX ($mode)" >&2
rm -f "$PREFIX/.baked"
"$PYTHON" -m venv --clear "$PREFIX"
pip=("$PREFIX/bin/python" -m pip install --disable-pip-version-check --no-input -q)
case $mode in
wheelhouse) "${pip[@]}" --no-index --find-links "$src" gce-watchdog ;;
wheel) "${pip[@]}" "$src" ;;
*) "${pip[@]}" "$spec" ;;
esac
version=$("$PREFIX/bin/gce-watchdog" --version)
if ((copy_script)); then
	install -D -m 0755 "$HERE/startup-script.sh" "$PREFIX/share/startup-script.sh"
fi
mkdir -p "$ROOT/etc/gce-watchdog/bootstrap.d"
if ((unit)); then
	if "$PREFIX/bin/gce-watchdog" install --help >/dev/null 2>&1; then
		# Enabled, not started: a watchdog running on the build VM could power it off mid-build.
		"$PREFIX/bin/gce-watchdog" install --no-start
	else
		echo "bake-image.sh: this agent has no install command; the unit is not installed" >&2
	fi
fi
# The marker the start-up script looks for: use this install as it is, never reinstall it.
printf '%s\n' "$version" >"$PREFIX/.baked"
echo "bake-image.sh: done: $version in $PREFIX" >&2
