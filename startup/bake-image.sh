#!/bin/bash
# bake-image.sh: pre-install the gce-watchdog agent (and its systemd unit, enabled, not started)
# into a VM image, so the start-up script finds it under /opt/gce-watchdog and downloads nothing
# at boot. Only pinned sources: the .deb (`make deb`), or a wheelhouse holding requirements.lock
# (`packaging/wheelhouse.sh`), installed with no package index at all.
#
# Run as root, either on the image-build VM itself (Packer), or on a build host against the
# image's file tree (--root DIR: everything runs inside it with chroot, with the image's own
# Python, so the agent runs in the image and not only on the build host):
#   bake-image.sh --deb FILE.deb [--root DIR]
#   bake-image.sh --wheelhouse DIR [--root DIR]
# Options: --python PY (default python3; the wheelhouse mode's venv interpreter, inside the root),
#          --no-unit (wheelhouse mode: do not run `gce-watchdog install`).
# Exit codes: 0 ok (the agent ran `--version` inside the image), 64 bad arguments, 1 refused
# before anything changed (no python3, a Python or a dependency the package or the wheelhouse
# does not fit) or the install failed (the message is above).
set -Eeuo pipefail
umask 022

ROOT="${GCEWD_ROOT:-}"
PREFIX=/opt/gce-watchdog
PYTHON="${GCEWD_PYTHON:-python3}"
mode="" src="" unit=1

usage() {
	sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
	exit 64
}
die() {
	echo "bake-image.sh: $*" >&2
	exit 64
}

while (($#)); do
	case "$1" in
	--deb) mode=deb src=${2:?--deb needs a file} && shift ;;
	--wheelhouse) mode=wheelhouse src=${2:?--wheelhouse needs a directory} && shift ;;
	--root) ROOT=${2:?--root needs a directory} && shift ;;
	--python) PYTHON=${2:?--python needs an interpreter} && shift ;;
	--no-unit) unit=0 ;;
	-h | --help) usage ;;
	--wheel | --spec) die "$1 is gone: it installed dependencies from a package index (unpinned). Use --deb or --wheelhouse" ;;
	*)
		echo "bake-image.sh: unknown argument '$1'" >&2
		usage
		;;
	esac
	shift
done

[[ -n $mode ]] || die "give --deb FILE or --wheelhouse DIR"
case $mode in
deb) [[ -f $src ]] || die "$src is not a file" ;;
wheelhouse)
	[[ -d $src ]] || die "$src is not a directory"
	[[ -f $src/requirements.lock ]] || die "$src has no requirements.lock (packaging/wheelhouse.sh makes one)"
	compgen -G "$src/gce_watchdog-*.whl" >/dev/null || die "$src has no gce_watchdog-*.whl"
	;;
esac
if [[ -n $ROOT ]]; then
	ROOT=$(cd "$ROOT" && pwd) || die "--root $ROOT is not a directory"
	[[ $ROOT != / ]] || ROOT=""
fi
if [[ -n $ROOT ]]; then
	[[ -x $ROOT/bin/sh ]] || die "$ROOT has no /bin/sh: not an image's file tree"
	[[ $(id -u) == 0 ]] || die "--root needs root (chroot)"
fi

# in_root CMD...: CMD in the image (chroot when a root is given).
in_root() {
	if [[ -n $ROOT ]]; then chroot "$ROOT" "$@"; else "$@"; fi
}

# Refuse an image this cannot finish, before anything in it changes (issue 27): no /tmp, no
# interpreter, a Python the package or the wheelhouse has no build for, a dependency missing.
refuse() {
	echo "bake-image.sh: refused, nothing in ${ROOT:-/} was changed: $*" >&2
	exit 1
}
[[ -d $ROOT/tmp ]] || refuse "${ROOT:-/} has no /tmp"
case $mode in
deb)
	command -v dpkg-deb >/dev/null || refuse "dpkg-deb missing on this host"
	depends=$(dpkg-deb -f "$src" Depends) || refuse "$src is not a Debian package"
	in_root dpkg-query --version >/dev/null 2>&1 || refuse "the image has no dpkg"
	# Every dependency must be installed in the image already: `dpkg -i` resolves nothing, and
	# a package whose dependencies are missing stays half-installed.
	IFS=, read -ra deps <<<"$depends"
	for dep in "${deps[@]}"; do
		shown=${dep#"${dep%%[![:space:]]*}"}
		dep=${dep//[[:space:]]/}
		name=${dep%%(*}
		# shellcheck disable=SC2016 # dpkg-query's format, not the shell's
		have=$(in_root dpkg-query -W -f '${db:Status-Status} ${Version}' "$name" 2>/dev/null) || have=""
		[[ $have == "installed "* ]] || refuse "$src needs $name, which the image does not have (apt-get install $name in it first, or use the package built for its release)"
		if [[ $dep == *"("* ]]; then
			rel=${dep#*(} && rel=${rel%)}
			op=${rel%%[0-9]*} ver=${rel#"$op"}
			case $op in '>=') op=ge ;; '<<') op=lt ;; '<=') op=le ;; '>>') op=gt ;; '=') op=eq ;; *) refuse "cannot read '$dep' in $src's Depends" ;; esac
			dpkg --compare-versions "${have#installed }" "$op" "$ver" ||
				refuse "$src needs $shown; the image has $name ${have#installed } (use the package built for the image's release: docs/packaging.md)"
		fi
	done
	;;
wheelhouse)
	pyver=$(in_root "$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
		refuse "no $PYTHON in the image to make the agent's venv with"
	want=$(sed -n 's/^# python: //p' "$src/requirements.lock")
	[[ -z $want || " $want " == *" $pyver "* ]] ||
		refuse "$PYTHON in the image is Python $pyver; the wheelhouse is for CPython $want"
	in_root "$PYTHON" -c 'import venv' 2>/dev/null || refuse "$PYTHON in the image has no venv module (apt-get install python3-venv in it)"
	;;
esac

echo "bake-image.sh: installing gce-watchdog into ${ROOT:-/}$PREFIX ($mode)" >&2
rm -f "$ROOT$PREFIX/.baked"
stage=$(mktemp -d "$ROOT/tmp/gce-watchdog-bake.XXXXXX")
trap 'rm -rf "$stage"' EXIT
inner=${stage#"$ROOT"}
case $mode in
deb)
	cp "$src" "$stage/gce-watchdog.deb"
	# The package enables its unit (also here, without a running systemd) and starts nothing.
	in_root env DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold "$inner/gce-watchdog.deb" >&2
	;;
wheelhouse)
	cp -r "$src/." "$stage/"
	in_root "$PYTHON" -m venv --clear "$PREFIX" >&2
	# --isolated: no PIP_* variables or pip.conf of this host or image (an index, extra links).
	pip=("$PREFIX/bin/python" -m pip --isolated install --disable-pip-version-check --no-input -q
		--no-index --find-links "$inner")
	if grep -q '^[A-Za-z0-9]' "$stage/requirements.lock"; then
		in_root "${pip[@]}" --require-hashes --only-binary=:all: -r "$inner/requirements.lock" >&2
	fi
	whl=$(find "$stage" -maxdepth 1 -name 'gce_watchdog-*.whl' | head -n1)
	in_root "${pip[@]}" --no-deps "$inner/$(basename "$whl")" >&2
	if ((unit)); then
		# Enabled, not started: a watchdog running on the build VM could power it off mid-build.
		in_root "$PREFIX/bin/gce-watchdog" install --no-start >&2
	fi
	;;
esac
mkdir -p "$ROOT/etc/gce-watchdog/bootstrap.d"
# The agent must run in the image, with the image's own Python (not only on this host).
version=$(in_root "$PREFIX/bin/gce-watchdog" --version) ||
	{ echo "bake-image.sh: the installed agent does not run inside ${ROOT:-/}" >&2 && exit 1; }
# The marker the start-up script looks for: use this install as it is, never reinstall it.
printf '%s\n' "$version" >"$ROOT$PREFIX/.baked"
echo "bake-image.sh: done: $version in ${ROOT:-/}$PREFIX" >&2
