#!/usr/bin/env bash
# A cached Debian file tree per release (docs/packaging.md): the build root the .deb of that
# release is built in (its own /usr/bin/python3), and the fresh trees the package tests install
# into. Run as root (debootstrap, chroot); needs Debian's archive once per release.
#
#   packaging/debroot.sh base RELEASE     -> prints build/cache/debroot/RELEASE-base.tar
#       debootstrap --variant=minbase RELEASE, its apt lists updated and the .debs of python3
#       (what the package depends on) in its apt cache, so `apt-get install ./pkg.deb` in a
#       copy resolves the dependencies without the network. Made once, then reused.
#   packaging/debroot.sh build RELEASE    -> prints build/debroot/RELEASE-build (a directory)
#       the base plus python3-venv and python3-pip: the .deb's venv is made and filled inside it
#       with that release's own python3 and pip. Made once, then reused (locked while in use).
#
# RELEASE: bookworm (Debian 12) or trixie (Debian 13). Env: GCEWD_MIRROR (default
# http://deb.debian.org/debian), GCEWD_DEBROOT_CACHE (default build/cache/debroot).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
kind="${1:?usage: debroot.sh base|build RELEASE}"
release="${2:?usage: debroot.sh base|build RELEASE}"
case "$release" in bookworm | trixie) ;; *)
  echo "debroot.sh: unknown release '$release' (bookworm or trixie)" >&2; exit 64 ;; esac
mirror="${GCEWD_MIRROR:-http://deb.debian.org/debian}"
cache="${GCEWD_DEBROOT_CACHE:-$repo/build/cache/debroot}"
[ "$(id -u)" = 0 ] || { echo "debroot.sh: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "debroot.sh: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }
mkdir -p "$cache"
# One run per release at a time: make test runs the package tests and the VM scenarios side by
# side, and both may make the same cached tree in a clean clone (held until this script exits).
exec 8>"$cache/.$release.lock"
flock 8

# in_tree DIR CMD...: CMD under chroot with /proc mounted and the host's resolver, no services.
in_tree() {
  local dir="$1"; shift
  cp -L /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  mountpoint -q "$dir/proc" || mount -t proc proc "$dir/proc"
  local rc=0
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 \
    chroot "$dir" "$@" || rc=$?
  umount "$dir/proc" || umount -l "$dir/proc" || true
  return $rc
}

base_tar="$cache/$release-base.tar"
make_base() {
  [ -s "$base_tar" ] && return 0
  local t0 tmp; t0=$(date +%s)
  tmp="$(mktemp -d "$cache/.$release-base.XXXXXX")"
  # shellcheck disable=SC2064
  trap "mountpoint -q '$tmp/proc' && umount -l '$tmp/proc'; rm -rf '$tmp'" EXIT
  debootstrap --variant=minbase "$release" "$tmp" "$mirror" >"$tmp.log" 2>&1 || {
    tail -20 "$tmp.log" >&2; rm -f "$tmp.log"; exit 1; }
  printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d" && chmod 755 "$tmp/usr/sbin/policy-rc.d"
  in_tree "$tmp" apt-get update -qq
  # With its Recommends: what `apt-get install ./gce-watchdog_*.deb` takes on a real system.
  in_tree "$tmp" apt-get install -y -qq --download-only python3 >/dev/null
  rm -f "$tmp/etc/resolv.conf" "$tmp.log"
  tar -C "$tmp" --numeric-owner -cf "$base_tar.tmp" . && mv "$base_tar.tmp" "$base_tar"
  echo "debroot.sh: $release base in $(($(date +%s) - t0))s -> $base_tar" >&2
  rm -rf "$tmp"; trap - EXIT
}

case "$kind" in
base)
  make_base
  echo "$base_tar"
  ;;
build)
  dir="$repo/build/debroot/$release-build"
  if [ ! -f "$dir/.complete" ]; then
    make_base
    t0=$(date +%s)
    rm -rf "$dir" && mkdir -p "$dir"
    tar -C "$dir" --numeric-owner -xf "$base_tar"
    in_tree "$dir" apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip >/dev/null
    in_tree "$dir" apt-get clean
    rm -f "$dir/etc/resolv.conf"
    touch "$dir/.complete"
    echo "debroot.sh: $release build root in $(($(date +%s) - t0))s -> $dir" >&2
  fi
  echo "$dir"
  ;;
*) echo "debroot.sh: unknown kind '$kind' (base or build)" >&2; exit 64 ;;
esac
