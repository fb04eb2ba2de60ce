#!/usr/bin/env bash
# Build (or reuse) the cached Debian minbase rootfs tarball for the e2e guest.
#
#   e2e/build-rootfs.sh OUTDIR      -> prints the path of OUTDIR/rootfs-<key>.tar
#
# The key hashes this script, packages.txt, the mirror and the suite, so a change to any of them
# builds a new tarball and an unchanged tree reuses the old one (debootstrap takes ~2 min).
# Mirror and suite come from the machine's own apt sources; the repository names no package host.
# E2E_MIRROR / E2E_SUITE override them.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build-rootfs.sh OUTDIR}"
mkdir -p "$out"

# First "deb" source of the host: a deb822 stanza in sources.list.d, else a one-line sources.list.
host_source() {
  local f uri="" suite=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    # Stanzas are separated by blank lines; take the first that is Types: deb and not -security.
    read -r uri suite < <(awk 'BEGIN{RS=""; FS="\n"}
      { t=""; u=""; s="";
        for (i=1;i<=NF;i++) {
          if ($i ~ /^Types:/) t=$i; if ($i ~ /^URIs:/) u=$i; if ($i ~ /^Suites:/) s=$i }
        if (t ~ /[ \t]deb([ \t]|$)/ && u != "" && s != "" && s !~ /-security/) {
          sub(/^URIs:[ \t]*/, "", u); sub(/^Suites:[ \t]*/, "", s);
          split(u, uu, /[ \t]+/); split(s, ss, /[ \t]+/); print uu[1], ss[1]; exit } }' "$f") || true
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    read -r uri suite < <(awk '$1=="deb" && $0 !~ /security/ {
      for (i=2;i<=NF;i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i, $(i+1); exit } }' \
      /etc/apt/sources.list) || true
  fi
  echo "$uri $suite"
}

read -r mirror suite < <(host_source)
mirror="${E2E_MIRROR:-$mirror}"
suite="${E2E_SUITE:-$suite}"
if [ -z "$mirror" ] || [ -z "$suite" ]; then
  echo "build-rootfs: no Debian mirror/suite found in /etc/apt/sources.list{,.d}; set E2E_MIRROR and E2E_SUITE" >&2
  exit 2
fi

pkgs="$(grep -v '^\s*#' "$here/packages.txt" | tr -s ' \n' ',' | sed 's/^,//; s/,$//')"
key="$(cat "$here/build-rootfs.sh" "$here/packages.txt" <(echo "$mirror $suite") | sha256sum | cut -c1-16)"
tarball="$out/rootfs-$key.tar"
if [ -s "$tarball" ]; then
  echo "build-rootfs: reusing $tarball" >&2
  echo "$tarball"
  exit 0
fi

stage="$(mktemp -d "$out/rootfs-stage.XXXXXX")"
cleanup() {
  # Unmount anything debootstrap left mounted before removing the stage.
  for m in proc sys dev/pts dev; do
    if mountpoint -q "$stage/$m" 2>/dev/null; then umount -l "$stage/$m" || true; fi
  done
  rm -rf "$stage"
}
trap cleanup EXIT

t0=$(date +%s)
echo "build-rootfs: debootstrap $suite from $mirror (minbase + $pkgs)" >&2
debootstrap --variant=minbase --include="$pkgs" "$suite" "$stage" "$mirror" > "$out/debootstrap.log" 2>&1 || {
  echo "build-rootfs: debootstrap failed; last lines of $out/debootstrap.log:" >&2
  tail -20 "$out/debootstrap.log" >&2
  exit 1
}
t1=$(date +%s)
chroot "$stage" apt-get clean
rm -rf "$stage"/var/lib/apt/lists/* "$stage"/var/cache/apt/*.bin
# The guest's Python version decides which wheels the wheelhouse needs (cp3XY).
chroot "$stage" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' > "$stage/.e2e-python-version"
tar --numeric-owner --xattrs --xattrs-include='*' -C "$stage" -cf "$tarball.tmp" .
mv "$tarball.tmp" "$tarball"
# Old tarballs of earlier keys are only disk space.
find "$out" -maxdepth 1 -name 'rootfs-*.tar' ! -name "rootfs-$key.tar" -delete
t2=$(date +%s)
echo "build-rootfs: debootstrap $((t1 - t0))s, tarball $((t2 - t1))s -> $tarball" >&2
echo "$tarball"
