#!/usr/bin/env bash
# Build (or reuse) the e2e guest disk image from the cached rootfs tarball plus e2e/guest/.
#
#   e2e/build-image.sh OUTDIR [--bake WHEELHOUSE_DIR]
#
# --bake: the same image with the agent from WHEELHOUSE_DIR (the run's wheelhouse, this tree's
# code) pre-installed by startup/bake-image.sh --no-unit, as an operator's baked image has it: the
# start-up script then skips the download and the install (`baked into the image`) and installs
# and starts the unit as on any image. The scenarios about the agent, not its install, boot it
# (docs/e2e.md, "Time"). Its key adds the wheelhouse's files and bake-image.sh.
#
# Writes OUTDIR/disk.img (raw ext4, the root filesystem), OUTDIR/vmlinuz, OUTDIR/initrd.img (booted
# with qemu -kernel/-initrd), OUTDIR/guest-python (e.g. "3.11") and OUTDIR/image.key. Reuses them
# when the key (rootfs tarball + guest files + this script) is unchanged.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build-image.sh OUTDIR [--bake WHEELHOUSE_DIR]}"
bake=""
if [ "${2:-}" = --bake ]; then
  bake="$(cd "${3:?--bake needs the wheelhouse directory}" && pwd)"
elif [ -n "${2:-}" ]; then
  echo "build-image: unknown argument '$2' (usage: build-image.sh OUTDIR [--bake WHEELHOUSE_DIR])" >&2
  exit 64
fi
cache="$(dirname "$out")/cache"  # shared with the wheelhouse cache
mkdir -p "$out" "$cache"
# One build per OUTDIR at a time: the shards of one run (e2e/shards.py) may ask for the baked
# image together; the second waits here, then finds the key and reuses what the first built.
exec 9>"$out/.build.lock"
flock 9

t0=$(date +%s)
tarball="$("$here/build-rootfs.sh" "$cache")"
t1=$(date +%s)
key="$( { basename "$tarball"; cat "$here/build-image.sh";
          (cd "$here/guest" && find . -type f | LC_ALL=C sort | xargs sha256sum);
          if [ -n "$bake" ]; then
            sha256sum "$here/../startup/bake-image.sh" | cut -d' ' -f1
            (cd "$bake" && find . -type f | LC_ALL=C sort | xargs sha256sum)
          fi; } \
        | sha256sum | cut -c1-16)"
if [ -s "$out/disk.img" ] && [ "$(cat "$out/image.key" 2>/dev/null)" = "$key" ]; then
  echo "build-image: reusing $out/disk.img (key $key)" >&2
  exit 0
fi

stage="$(mktemp -d "$out/image-stage.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
tar --numeric-owner --xattrs --xattrs-include='*' -C "$stage" -xf "$tarball"
# The guest files: a start-up script runner like GCE's, a static network config, DNS and hosts
# pointing at the metadata server, fw_cfg module loading, guest-configs' rsyslog console rule.
cp -rT --no-preserve=ownership "$here/guest" "$stage"
chroot "$stage" systemctl enable systemd-networkd.service gce-startup.service >/dev/null 2>&1
# Not masked: serial-getty@ttyS0, as on a GCE image (systemd-getty-generator starts it for
# console=ttyS0; its TTYVHangup= hangs up the port the agent writes to at every start, which the
# agent's writer must survive, issue 23). Masked: tty1's getty (no display here) and apt's daily
# timers (they only burn CPU under TCG).
chroot "$stage" systemctl mask getty@tty1.service \
  apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1
# The serial-console test user (docs/e2e.md): exists in this test image only, never on a GCE image.
# The healthy scenario logs in as it on ttyS0 through the qemu socket chardev (e2e/vm.py
# CONSOLE_USER / CONSOLE_PASSWORD, which must match these two).
console_user=gcewd-e2e
console_password=e2e-serial-console
chroot "$stage" useradd --create-home --shell /bin/bash "$console_user"
echo "$console_user:$console_password" | chroot "$stage" chpasswd
# rsyslog (e2e/packages.txt) with guest-configs' console rule (e2e/guest/etc/rsyslog.d/): its
# package enables it already; said again so a change of that default shows here.
chroot "$stage" systemctl enable rsyslog.service >/dev/null 2>&1
# A fixed machine-id: an empty one makes every -snapshot boot a "first boot" (preset-all).
head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$stage/etc/machine-id"
echo >> "$stage/etc/machine-id"
if [ -n "$bake" ]; then
  # The unit is left to the start-up script (it installs it after the runner put the run's
  # config.toml in place), so a baked agent never starts at boot with another config.
  "$here/../startup/bake-image.sh" --wheelhouse "$bake" --root "$stage" --no-unit >&2
fi
vmlinuz="$(find "$stage/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -1)"
initrd="$(find "$stage/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -1)"
cp "$vmlinuz" "$out/vmlinuz.tmp" && mv "$out/vmlinuz.tmp" "$out/vmlinuz"
cp "$initrd" "$out/initrd.img.tmp" && mv "$out/initrd.img.tmp" "$out/initrd.img"
cp "$stage/.e2e-python-version" "$out/guest-python"
# Room for the agent's venv, its state and logs on top of what the rootfs uses.
used_mb=$(du -sm "$stage" | cut -f1)
size_mb=$((used_mb + 768))
rm -f "$out/disk.img.tmp"
truncate -s "${size_mb}M" "$out/disk.img.tmp"
mkfs.ext4 -q -F -L root -d "$stage" "$out/disk.img.tmp" "${size_mb}M"
mv "$out/disk.img.tmp" "$out/disk.img"
echo "$key" > "$out/image.key"
t2=$(date +%s)
echo "build-image: rootfs $((t1 - t0))s, image $((t2 - t1))s (${size_mb} MB) -> $out/disk.img" >&2
