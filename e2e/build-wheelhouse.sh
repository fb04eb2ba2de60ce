#!/usr/bin/env bash
# Build the wheelhouse the fake GCE serves to the e2e guest: the agent's wheel (built from this
# tree on every run) plus its runtime dependencies as binary wheels for the GUEST's Python
# (cached, keyed by the dependency list and the guest's Python version), so `pip install
# --no-index --find-links URL gce-watchdog` works offline in the guest.
#
#   e2e/build-wheelhouse.sh OUTDIR GUEST_PY_VERSION     e.g. build/e2e/www 3.11
#
# Writes OUTDIR/wheelhouse/*.whl and OUTDIR/wheelhouse.tar (the same wheels: what the start-up
# script's `gce-watchdog-wheel-url` points at). OUTDIR is what the fake GCE's file server serves.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
out="${1:?usage: build-wheelhouse.sh OUTDIR GUEST_PY_VERSION}"
pyver="${2:?usage: build-wheelhouse.sh OUTDIR GUEST_PY_VERSION}"
py="$repo/.venv/bin/python"
[ -x "$py" ] || py=python3
t0=$(date +%s)

# Runtime dependencies as pyproject declares them (one requirement per line).
deps="$("$py" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
)"
key="$(printf '%s\n%s\n' "$deps" "$pyver" | sha256sum | cut -c1-16)"
cache="$(dirname "$out")/cache/wheels-$key"
wh="$out/wheelhouse"
if [ ! -s "$cache/.complete" ]; then
  rm -rf "$cache" && mkdir -p "$cache"
  nodot="${pyver//./}"
  # Binary wheels only, for the guest's CPython and glibc (Debian's glibc is far above 2.17).
  mapfile -t reqs <<< "$deps"
  "$py" -m pip download -q --dest "$cache" --only-binary=:all: \
    --implementation cp --python-version "$pyver" --abi "cp$nodot" --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any "${reqs[@]}" > "$cache.log" 2>&1 || {
      grep -v 'is ignored: it is neither' "$cache.log" >&2; exit 1; }
  echo "$deps" > "$cache/.complete"
fi
rm -rf "$wh" "$out/wheelhouse.tar" && mkdir -p "$wh"
cp "$cache"/*.whl "$wh/"
# The agent itself, from the working tree. The wheel goes through a temp dir: setuptools leaves
# build/ and *.egg-info next to the sources otherwise (both ignored).
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip wheel -q --no-deps -w "$tmp" "$repo" > "$tmp/log" 2>&1 || { cat "$tmp/log" >&2; exit 1; }
cp "$tmp"/gce_watchdog-*.whl "$wh/"
tar -C "$wh" -cf "$out/wheelhouse.tar.tmp" . && mv "$out/wheelhouse.tar.tmp" "$out/wheelhouse.tar"
t1=$(date +%s)
echo "build-wheelhouse: $(find "$wh" -name '*.whl' | wc -l) wheels for cp${pyver} in $((t1 - t0))s -> $out/wheelhouse.tar" >&2
