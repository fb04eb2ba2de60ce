#!/bin/bash
# gce-watchdog start-up script: put it in the `startup-script` metadata key (or bake it into an
# image and point `startup-script-url` at it). It runs as root at every boot and is safe to run
# again: see docs/bootstrap.md for the steps, the metadata attributes and the exit codes.
#
# Steps: phase bootstrap -> wait for DNS -> install the agent from a pinned source only (baked
# /opt/gce-watchdog, else a .deb with its sha256, else a wheelhouse with its sha256 whose
# dependencies install with --require-hashes; never a package index) -> install and start the
# systemd unit -> operator bootstrap steps -> phase workload + the workload under
# `gce-watchdog exec` -> phase done.
# Any failure: a `setup_failed` line (step, reason, rc, cause=infra|job), drained, then the
# failure action (default: power off). cause=infra (the network, DNS or the package source never
# came up) lets the poller fail over; cause=job (the step itself failed) does not.
# Every end of the VM (the done action, the failure action) goes through the agent's one
# end-of-life chain (`gce-watchdog end`: linger so a poller reads the terminal line while the VM
# is RUNNING, agent.action, power-off with escalation); the script's own chain (end_here) only
# when no agent could be installed.
#
# Every line written to the serial port is a protocol v3 line (docs/serial-protocol.md), also
# before the agent is installed: EMITTER_PY below is the one encoder besides agent/gce_watchdog/wire/protocol.py,
# and tests/integration/test_startup_script.py checks that gce_watchdog.wire.protocol decodes what it writes.
#
# `startup-script.sh emit EVENT [key=value ...] [-- text]` writes one line and exits (for
# bootstrap steps that run before the agent exists).
set -Eeuo pipefail
umask 022

# ---- paths and knobs: every one can be overridden from the environment (tests use a temp root)
ROOT="${GCEWD_ROOT:-}"
PREFIX="${GCEWD_PREFIX:-$ROOT/opt/gce-watchdog}"
STATE_DIR="${GCEWD_STATE_DIR:-$ROOT/var/lib/gce-watchdog}"
RUN_DIR="${GCEWD_RUN_DIR:-$ROOT/run/gce-watchdog}"
SERIAL="${GCEWD_SERIAL:-$ROOT/dev/ttyS0}"
SERIAL_FALLBACK="${GCEWD_SERIAL_FALLBACK:-$ROOT/var/log/gce-watchdog/serial.log}"
CONFIG="${GCEWD_CONFIG:-$ROOT/etc/gce-watchdog/config.toml}"
BOOTSTRAP_DIR="${GCEWD_BOOTSTRAP_DIR:-$ROOT/etc/gce-watchdog/bootstrap.d}"
# The gce-watchdog-config attribute's drop-in: config.d/ beside the config file, where the agent
# reads it (after config.toml and any lower-numbered drop-in, before higher-numbered ones).
MD_DROPIN="$(dirname "$CONFIG")/config.d/50-metadata.toml"
CACHE_DIR="${GCEWD_CACHE_DIR:-$ROOT/var/cache/gce-watchdog}"
METADATA_URL="${GCEWD_METADATA_URL:-http://169.254.169.254/computeMetadata/v1}"
BOOT_ID_PATH="${GCEWD_BOOT_ID_PATH:-/proc/sys/kernel/random/boot_id}"
SYSTEMD_RUN_DIR="${GCEWD_SYSTEMD_RUN_DIR:-/run/systemd/system}"
PYTHON="${GCEWD_PYTHON:-python3}"
# The failure action runs as "$ACTION_CMD <action>" (systemctl poweroff / systemctl reboot).
ACTION_CMD="${GCEWD_ACTION_CMD:-systemctl}"
# The script's own end of life (end_here, only without an agent): waits after an accepted
# `systemctl poweroff` (a graceful stop; systemd's default per-unit stop timeout is 90 s) and
# `--force`, then the kernel's power-off by sysrq. Tests shorten them and point sysrq at a file.
POWEROFF_WAIT="${GCEWD_POWEROFF_WAIT:-120}"
FORCE_WAIT="${GCEWD_FORCE_WAIT:-30}"
SYSRQ="${GCEWD_SYSRQ:-/proc/sysrq-trigger}"
# The linger before the power-off: gce-watchdog-linger, else this (two polls of a 30 s poller
# plus 15 s for the read itself: docs/actions.md).
DEFAULT_LINGER="${GCEWD_DEFAULT_LINGER:-75}"
# Installs a downloaded .deb: "$DPKG -i --force-confold FILE" (tests: a recorder).
DPKG="${GCEWD_DPKG:-dpkg}"
# Deadlines in seconds. DNS: a fresh Spot VM's resolver is normally up within a minute; five
# leave room for a slow one without hiding a broken VPC for long.
DNS_DEADLINE="${GCEWD_DNS_DEADLINE:-300}"
DOWNLOAD_DEADLINE="${GCEWD_DOWNLOAD_DEADLINE:-600}"   # per download, across all its retries
METADATA_DEADLINE="${GCEWD_METADATA_DEADLINE:-120}"   # the metadata server is local: 2 min
STEP_TIMEOUT="${GCEWD_STEP_TIMEOUT:-3600}"            # one operator bootstrap step
SERIAL_EVERY=60   # at most one `fetch out=retry` line per minute per download

AGENT="$PREFIX/bin/gce-watchdog"
STEP=init
CFG_ARGS=()
RESTART_AGENT=0  # the metadata drop-in changed under an agent already running: restart it
MD_LINGER=""

log() { printf '%s gce-watchdog-startup: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }

# ---- the pre-agent emitter ----------------------------------------------------------------------
# Same wire format (v3, Ed25519-signed) as agent/gce_watchdog/wire/protocol.py, same key file and seq
# file (<run>/seq.<boot>, fixed width, under flock) as
# agent/gce_watchdog/vm/state.py's SeqAllocator, same port semantics as agent/gce_watchdog/vm/console.py (one write, then tcdrain
# on a tty or fsync on a file; the fallback file when the device cannot be opened), same boot
# counter (<state>/boot.count under its flock, agent/gce_watchdog/vm/bootcount.py: bc on every line).
read -r -d '' EMITTER_PY <<'PY' || true
import base64, fcntl, hashlib, json, os, re, secrets, stat, sys, termios, time, zlib
P25519, L25519 = 2**255 - 19, 2**252 + 27742317777372353535851937790883648493
def ed25519(seed, msg):
    # RFC 8032 section 5.1 (Ed25519), the reference's extended coordinates: libsodium (the
    # agent's PyNaCl) and this give the same bytes (signing is deterministic; tested).
    p, L = P25519, L25519
    d = -121665 * pow(121666, p - 2, p) % p
    def add(P, Q):
        a = (P[1] - P[0]) * (Q[1] - Q[0]) % p
        b = (P[1] + P[0]) * (Q[1] + Q[0]) % p
        c, dd = 2 * P[3] * Q[3] * d % p, 2 * P[2] * Q[2] % p
        e, f, g, h = b - a, dd - c, dd + c, b + a
        return (e * f % p, g * h % p, f * g % p, e * h % p)
    def mul(s, P):
        Q = (0, 1, 1, 0)
        while s:
            if s & 1:
                Q = add(Q, P)
            P, s = add(P, P), s >> 1
        return Q
    def enc(P):
        zi = pow(P[2], p - 2, p)
        x, y = P[0] * zi % p, P[1] * zi % p
        return (y | (x & 1) << 255).to_bytes(32, "little")
    gy = 4 * pow(5, p - 2, p) % p
    x2 = (gy * gy - 1) * pow(d * gy * gy + 1, p - 2, p) % p
    gx = pow(x2, (p + 3) // 8, p)
    if (gx * gx - x2) % p:
        gx = gx * pow(2, (p - 1) // 4, p) % p
    if gx & 1:
        gx = p - gx
    G = (gx, gy, 1, gx * gy % p)
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little") & ((1 << 254) - 8) | (1 << 254)
    A = enc(mul(a, G))
    r = int.from_bytes(hashlib.sha512(h[32:] + msg).digest(), "little") % L
    R = enc(mul(r, G))
    k = int.from_bytes(hashlib.sha512(R + A + msg).digest(), "little") % L
    return R + ((r + k * a) % L).to_bytes(32, "little"), A
def read_key(p):
    # agent/gce_watchdog/vm/state.py _read_key: a regular file of 32 bytes, whatever its mode
    # (a wrong mode is reported, never a reason to replace the key). PermissionError: not root.
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, False
    except PermissionError:
        raise
    except OSError as e:
        sys.stderr.write("emit: %s: %s (not used, not replaced)\n" % (p, e))
        return None, True
    try:
        st, k = os.fstat(fd), os.read(fd, 33)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or len(k) != 32:
        sys.stderr.write("emit: %s is not a 32-byte file (not used, not replaced)\n" % p)
        return None, True
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        sys.stderr.write("emit: %s: mode %o uid %d (kept)\n" % (p, st.st_mode & 0o777, st.st_uid))
    return k, False
def create_key(d, k):
    os.makedirs(d, 0o755, exist_ok=True)
    p, tmp = os.path.join(d, "signing.key"), os.path.join(d, ".signing.key.%d.tmp" % os.getpid())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if os.write(fd, k) != 32:
                raise OSError("short write of the key")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)
        except FileExistsError:
            pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return read_key(p)[0]
def key_of(state, run):
    # agent/gce_watchdog/vm/state.py load_line_key: (seed, ephemeral); never replaces a key
    try:
        k, broken = read_key(os.path.join(state, "signing.key"))
        if k is not None:
            return k, False
        boot_k = read_key(os.path.join(run, "signing.key"))[0]
    except PermissionError as e:
        sys.stderr.write("emit: %s\n" % e)
        return None, False
    if not broken:
        try:
            k = create_key(state, boot_k or secrets.token_bytes(32))
            if k is not None:
                return k, False
        except OSError as e:
            if isinstance(e, PermissionError) and os.geteuid() != 0:
                return None, False
            sys.stderr.write("emit: no key in %s: %s\n" % (state, e))
    if boot_k is not None:
        return boot_k, True
    try:
        k = create_key(run, secrets.token_bytes(32))
        if k is not None:
            return k, True
    except OSError as e:
        if isinstance(e, PermissionError) and os.geteuid() != 0:
            return None, False
        sys.stderr.write("emit: no key in %s: %s\n" % (run, e))
    return secrets.token_bytes(32), True
def next_seq(run, boot, last=[-1]):
    # agent/gce_watchdog/vm/state.py SeqAllocator: <run>/seq.<boot>, fixed width, in place
    try:
        os.makedirs(run, 0o755, exist_ok=True)
        fd = os.open(os.path.join(run, "seq." + boot), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            old = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            if old.isdigit():
                n = int(old)
            elif old:  # a corrupt record: never back to 0 (state.py SeqAllocator)
                n = max(last[0] + 1, time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000)
            else:
                n = 0
            rec = ("%020d\n" % (n + 1)).encode()
            if os.pwrite(fd, rec, 0) != len(rec):
                raise OSError("short write")
        finally:
            os.close(fd)
    except OSError as e:
        sys.stderr.write("emit: seq file unusable (%s), numbering from CLOCK_BOOTTIME\n" % e)
        # seq 0 and 1 (always the announcement) from memory: the boot's start stays pinnable
        floor = last[0] + 1 if last[0] < 1 else time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000
        n = max(last[0] + 1, floor)
    last[0] = n
    return n
def read_regular(p):
    # never follows a link nor blocks on a FIFO; None: absent; OSError: unusable
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        return os.read(fd, 256)
    finally:
        os.close(fd)
def boot_count(state, run, bid):
    # agent/gce_watchdog/vm/bootcount.py: (bc, problem); before the key is created
    cache = os.path.join(run, "bc." + bid[:8])
    try:
        v, _, why = (read_regular(cache) or b"").decode("ascii").strip().partition(" ")
        if v == "-" or (v.isdigit() and v[0] != "0" and len(v) <= 12):
            return v, (why or "settled earlier in this boot") if v == "-" else ""
    except (OSError, ValueError):
        pass
    bc, why, lock = "-", "", None
    try:
        os.makedirs(state, 0o755, exist_ok=True)
        lock = os.open(os.path.join(state, "boot.count.lock"),
                       os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(lock).st_mode):
            raise OSError("the lock is not a regular file")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError:
        if lock is not None:
            os.close(lock)
        lock = None
    try:
        try:
            raw = read_regular(os.path.join(state, "boot.count"))
            parts = raw.decode("ascii").split() if raw is not None else None
            if parts is not None and not (
                raw.endswith(b"\n") and len(parts) == 2 and parts[0].isdigit()
                and (parts[0] == "0" or parts[0][0] != "0") and int(parts[0]) <= 999999999999
                and len(parts[1]) == 32 and not set(parts[1]) - set("0123456789abcdef")):
                raise ValueError("garbage")
        except (OSError, ValueError) as e:
            why = "boot.count cannot be used (%s): the counter is lost" % e
            parts = None
        if why:
            pass
        elif parts is None and os.path.lexists(os.path.join(state, "signing.key")):
            why = "boot.count is missing while signing.key exists: lost"
        elif parts is not None and parts[1] == bid and int(parts[0]) >= 1:
            bc = parts[0]
        elif parts is not None and int(parts[0]) >= 999999999999:
            why = "boot.count is at its maximum (999999999999)"
        elif lock is None:
            why = "boot.count cannot be written (no lock)"
        else:
            n = int(parts[0]) + 1 if parts is not None else 1
            tmp = os.path.join(state, ".boot.count.%d.tmp" % os.getpid())
            try:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    try:
                        data = ("%d %s\n" % (n, bid)).encode()
                        if os.write(fd, data) != len(data):
                            raise OSError("short write")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    os.replace(tmp, os.path.join(state, "boot.count"))
                finally:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                dfd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                bc = str(n)
            except OSError as e:
                why = "boot.count cannot be written (%s)" % (e.strerror or e)
    finally:
        if lock is not None:
            os.close(lock)
    try:
        os.makedirs(run, 0o755, exist_ok=True)
        tmp = os.path.join(run, ".bc.%s.%d.tmp" % (bid[:8], os.getpid()))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (("%s %s" % (bc, why))[:200].strip() + "\n").encode("ascii", "replace"))
        finally:
            os.close(fd)
        os.replace(tmp, cache)
    except OSError:
        pass
    return bc, why
def b64(b):
    return base64.urlsafe_b64encode(b).decode().rstrip("=")
def sign(body, key):
    # v3: body " #" signature (86 base64url) crc (8 hex, over everything before it)
    b = body.encode()
    signed = b + b" #" + b64(ed25519(key, b)[0]).encode()
    return "%s%08x" % (signed.decode(), zlib.crc32(signed) & 0xFFFFFFFF)
def instance_id(state):
    try:
        with open(os.path.join(state, "instance.json"), "rb") as f:
            iid = str(json.loads(f.read(4096)).get("id", ""))
    except (OSError, ValueError, AttributeError):
        return "-"
    return iid if iid.isdigit() and len(iid) <= 20 else "-"
def main(argv):
    event, rest = argv[0], argv[1:]
    text = ""
    if "--" in rest:
        i = rest.index("--")
        text, rest = " ".join(rest[i + 1:]), rest[:i]
    bad = re.compile(r"[^A-Za-z0-9._:/@,+%~()<>\[\]-]")
    fields, phase = [], None
    for kv in rest:
        k, _, v = kv.partition("=")
        limit = 32 if k in ("reason", "step") else 64
        v = bad.sub("_", v)[:limit] or "-"
        fields.append(k + "=" + v)
        if event == "phase" and k == "ph":
            phase = v
    if event == "setup_failed":
        phase = "setup_failed"
    text = re.sub(r"[^\x20-\x22\x24-\x7e]", "_", text)[:100].strip()
    try:
        with open(os.environ["GCEWD_BOOT_ID_PATH"]) as f:
            raw = f.read().strip().replace("-", "").lower()
    except OSError:
        raw = ""
    if not raw or any(c not in "0123456789abcdef" for c in raw):
        raw = "0" * 32
    boot = (raw + "0" * 8)[:8]
    state, run = os.environ["GCEWD_STATE_DIR"], os.environ["GCEWD_RUN_DIR"]
    raw = (raw + "0" * 32)[:32]  # vm/state.py read_boot_id: exactly 32 hex
    bc, bc_why = boot_count(state, run, raw)  # before the key: see vm/bootcount.py
    key, eph = key_of(state, run)
    if key is None:
        sys.stderr.write("emit: no line key, the line is not written (not root?)\n")
        return
    ms = int(time.time() * 1000)
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + ".%03dZ" % (ms % 1000)
    lines = []
    line = write_one(lines, key, eph, boot, raw, ts, state, run, bc, event, fields, text)
    if bc_why:  # once per process: the counter is gone (vm/console.py Emitter)
        why = "no boot counter, bc=-: boots of this VM are ordered by position only (%s)" % bc_why
        why = re.sub(r"[^\x20-\x22\x24-\x7e]", "_", why)[:100].strip()
        write_one(lines, key, eph, boot, raw, ts, state, run, bc, "warn", ["what=bootcount"], why)
    if phase is not None:
        try:
            tmp = os.path.join(state, ".phase.%d.tmp" % os.getpid())
            with open(tmp, "w") as f:
                f.write(phase + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(state, "phase"))
        except OSError as e:
            sys.stderr.write("emit: cannot record phase: %s\n" % e)
    data = "".join(ln + "\n" for ln in lines).encode("ascii", "replace")
    for path in (os.environ["GCEWD_SERIAL"], os.environ["GCEWD_SERIAL_FALLBACK"]):
        try:
            flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC | os.O_APPEND
            try:
                is_chr = stat.S_ISCHR(os.stat(path).st_mode)
            except FileNotFoundError:
                is_chr = False
            if is_chr:
                fd = os.open(path, flags | os.O_NONBLOCK)
                os.set_blocking(fd, True)
            else:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                fd = os.open(path, flags | os.O_CREAT, 0o640)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if os.isatty(fd):
                    termios.tcdrain(fd)
                else:
                    os.fsync(fd)
            finally:
                os.close(fd)
            break
        except OSError as e:
            sys.stderr.write("emit: %s: %s\n" % (path, e))
    sys.stderr.write(line + "\n")
def write_one(lines, key, eph, boot, raw, ts, state, run, bc, event, fields, text):
    seq = next_seq(run, boot)
    # the announcement: seq 0 and 1 of a boot and every multiple of 32 (protocol
    # needs_announcement), with the boot counter and, where the whole of it fits, the full
    # boot id (wire/keys.py announce_event); never copied to stderr
    while seq <= 1 or seq % 32 == 0:
        pk = b64(ed25519(key, b"")[1])
        ann = ["GCEWD3", boot, str(seq), ts, "key", "pk=" + pk, "inst=" + instance_id(state)]
        ann += (["eph=1"] if eph else []) + ["bc=" + bc]
        if len(" ".join(ann + ["bid=" + raw])) + 96 <= 280:
            ann.append("bid=" + raw)
        lines.append(sign(" ".join(ann), key))
        seq = next_seq(run, boot)
    head = " ".join(["GCEWD3", boot, str(seq), ts, event])
    fields = list(fields)
    tail = " bc=" + bc  # every line's last field, never shortened (wire/line.py make_event)
    # Fields alone too long for 280 bytes (a long host and file name): shorten the longest value,
    # as a reader would reject the whole line otherwise. Every pass makes the line shorter.
    # The trailer " #" + signature (86) + crc (8 hex) is 96 bytes.
    while fields:
        over = len(" ".join([head] + fields) + tail) + 96 - 280
        if over <= 0:
            break
        i = max(range(len(fields)), key=lambda j: len(fields[j]))
        k, _, v = fields[i].partition("=")
        if len(v) > 1:
            fields[i] = k + "=" + v[: max(1, len(v) - over)]
        else:
            del fields[i]
    body = " ".join([head] + fields) + tail
    room = 280 - len(body) - len(" | ") - 96
    if len(text) > room:
        text = text[: max(0, room - 3)].rstrip() + "..." if room > 3 else ""
    if text:
        body += " | " + text
    line = sign(body, key)
    lines.append(line)
    return line
main(sys.argv[1:])
PY

# emit EVENT [key=value ...] [-- text]: one protocol line, synchronously. Never fails the caller.
emit() {
	GCEWD_STATE_DIR="$STATE_DIR" GCEWD_RUN_DIR="$RUN_DIR" GCEWD_SERIAL="$SERIAL" GCEWD_SERIAL_FALLBACK="$SERIAL_FALLBACK" \
		GCEWD_BOOT_ID_PATH="$BOOT_ID_PATH" "$PYTHON" -c "$EMITTER_PY" "$@" ||
		log "could not write a serial line: $*"
}

have_agent() { [[ -x $AGENT ]] && "$AGENT" --version >/dev/null 2>&1; }

# phase NAME: through the agent when it is installed (it also records the phase), else directly.
phase() {
	if have_agent && "$AGENT" phase "${CFG_ARGS[@]}" "$1"; then
		return 0
	fi
	emit phase "ph=$1"
}

step_done() { # NAME STATUS STARTED_AT [text...]
	local name=$1 st=$2 t0=$3
	shift 3
	emit bootstrap_step "step=$name" "st=$st" "dur=$((SECONDS - t0))" -- "$@"
}

# linger_seconds VALUE: gce-watchdog-linger as whole seconds ("90", "90s", "2m"; 0 to 1 h), or
# DEFAULT_LINGER when empty or invalid (an ending never fails over a bad value).
linger_seconds() {
	local v=${1:-} n
	if [[ $v =~ ^([0-9]{1,4})(s|m)?$ ]]; then
		n=$((10#${BASH_REMATCH[1]}))
		[[ ${BASH_REMATCH[2]} != m ]] || n=$((n * 60))
		if ((n <= 3600)); then
			printf '%s\n' "$n"
			return 0
		fi
	fi
	[[ -z $v ]] || log "gce-watchdog-linger '$v' is not 0 to 1h in s or m: lingering ${DEFAULT_LINGER}s"
	printf '%s\n' "$DEFAULT_LINGER"
}

# end_here REASON [LINGER]: the script's own end of life, only when no agent could do it: the
# same order as the agent's chain (docs/actions.md). An `end` line, the linger (the terminal line
# is already drained: a poller reads it while the VM is RUNNING), then power-off with
# escalation, each step bounded: `systemctl poweroff`, waited for; `systemctl poweroff --force
# --force` (systemctl(1): "executed immediately without terminating any processes or unmounting
# any file systems"); sysrq `o`. SIGTERM/SIGHUP are ignored from here on: systemd stopping units
# during the very power-off this started must not stop the escalation.
end_here() {
	local reason=$1 linger=${2:-}
	[[ -n $linger ]] || linger=$(linger_seconds "$MD_LINGER")
	trap '' TERM HUP
	emit end "reason=$reason" action=poweroff chain=linger+poweroff+force+kernel -- \
		"no agent: ending the VM after ${linger}s"
	log "end of life ($reason) without the agent: lingering ${linger}s, then powering off"
	sleep "$linger"
	if timeout 30 "$ACTION_CMD" poweroff; then
		sleep "$POWEROFF_WAIT"
		log "still up ${POWEROFF_WAIT}s after '$ACTION_CMD poweroff': forcing"
	else
		log "'$ACTION_CMD poweroff' failed: forcing"
	fi
	if timeout 30 "$ACTION_CMD" poweroff --force --force; then
		sleep "$FORCE_WAIT"
		log "still up ${FORCE_WAIT}s after '$ACTION_CMD poweroff --force --force': sysrq"
	fi
	{ echo o >"$SYSRQ"; } 2>/dev/null || log "cannot write $SYSRQ: the VM may stay up"
}

# end_vm REASON: the VM's end of life (done, failed, setup_failed), after its terminal line was
# written and drained: the agent's one chain when the agent is installed (it hands the ending to
# the running agent, or runs the chain itself), else end_here.
end_vm() {
	local reason=$1 rc=0 linger=()
	[[ -z $MD_LINGER ]] || linger=(--linger "$MD_LINGER")
	if have_agent; then
		"$AGENT" end "${CFG_ARGS[@]}" --reason "$reason" "${linger[@]}" 9>&- || rc=$?
		((rc != 0)) || return 0
		if ((rc == 69)); then # the agent's whole chain ran (to the kernel step): still up
			log "gce-watchdog end: its chain ran through and the VM is still up"
			return 0
		fi
		log "gce-watchdog end exited $rc: ending with the script's own chain"
	fi
	end_here "$reason"
}

# A reboot is not an end of life: the instance stays RUNNING (its serial output readable), so it
# is run as it is. poweroff (the default) and anything unknown end the VM through end_vm.
failure_action() {
	local action="${GCEWD_FAILURE_ACTION:-${MD_FAILURE_ACTION:-poweroff}}"
	case "$action" in
	none) log "failure action: none, the VM stays up" ;;
	reboot)
		log "failure action: $ACTION_CMD reboot"
		"$ACTION_CMD" reboot || log "failure action '$ACTION_CMD reboot' failed: rc=$?"
		;;
	poweroff) end_vm setup_failed ;;
	*)
		log "unknown failure action '$action' (want poweroff, reboot or none): powering off"
		end_vm setup_failed
		;;
	esac
}

# fail STEP REASON [RC] [CAUSE]: the setup_failed line (drained before we go on), the failure
# action, exit. CAUSE: infra (network, DNS, the package source never came up) or job (default).
# In a subshell (a command substitution, where set -E runs the ERR trap too) it only hands the
# failure to the main shell through FAIL_NOTE and exits: the main shell's ERR trap then fires for
# the substitution and reports it, so one failure is one line and one failure action, not two.
FAIL_NOTE=""
fail() {
	trap - ERR
	set +e
	local step=$1 reason=$2 rc=${3:-1} cause=${4:-job}
	((rc != 0)) || rc=1
	[[ $cause == infra ]] || cause=job
	if [[ $BASHPID != "$$" ]]; then
		[[ -z $FAIL_NOTE ]] || printf '%s\n%s\n%s\n%s\n' "${step//$'\n'/ }" "${reason//$'\n'/ }" "$rc" "$cause" >"$FAIL_NOTE"
		exit "$rc"
	fi
	log "FAILED at step $step (rc=$rc, cause=$cause): $reason"
	if ! { have_agent && "$AGENT" setup-failed "${CFG_ARGS[@]}" --step "$step" \
		--reason "$reason" --exit-code "$rc" --cause "$cause" 2>/dev/null; }; then
		emit setup_failed "step=$step" "reason=$reason" "rc=$rc" "cause=$cause" -- "$reason"
	fi
	failure_action
	exit "$rc"
}

on_error() { # an unexpected failure under set -e
	local rc=$1 line=$2 cmd=$3 s r c k=job
	# A subshell's own failure, inside the substitution that just failed here: its detail wins.
	if [[ $BASHPID == "$$" && -n $FAIL_NOTE && -s $FAIL_NOTE ]] &&
		{ read -r s && read -r r && read -r c && { read -r k || true; }; } <"$FAIL_NOTE"; then
		rm -f "$FAIL_NOTE"
		[[ $c =~ ^[0-9]+$ ]] || c=$rc
		fail "$s" "$r" "$c" "$k"
	fi
	fail "$STEP" "line $line: ${cmd:0:80}" "$rc"
}

# ---- network helpers ---------------------------------------------------------------------------
# A URL as logs and serial lines show it: scheme://host[:port]/path. The userinfo (user:TOKEN@),
# the query (a signed URL's signature) and the fragment are removed: the runner copies stderr to
# the serial console, readable by anyone allowed getSerialPortOutput.
shown_url() {
	local u=${1%%[?#]*} scheme=""
	if [[ $u =~ ^[a-zA-Z][a-zA-Z0-9+.-]*:// ]]; then
		scheme=${BASH_REMATCH[0]}
		u=${u#"$scheme"}
	fi
	local auth=${u%%/*}
	[[ $auth != *@* ]] || u=${u#"${auth%@*}@"}
	printf '%s\n' "$scheme$u"
}

url_host() { # URL -> host (userinfo skipped, brackets of an IPv6 literal removed)
	local re='^[a-zA-Z][a-zA-Z0-9+.-]*://([^/?#]*@)?(\[([^]]+)\]|([^]/:?#@[]+))'
	[[ $1 =~ $re ]] || return 1
	printf '%s\n' "${BASH_REMATCH[3]}${BASH_REMATCH[4]}"
}

# wait_dns NAME SECONDS: until NAME resolves through the system resolver (nsswitch: /etc/hosts,
# then DNS), at most SECONDS. One look-up is bounded by 5 s (the guest agent's spacing).
wait_dns() {
	local name=$1 end=$((SECONDS + $2)) n=0 left
	while :; do
		n=$((n + 1))
		left=$((end - SECONDS))
		((left > 0)) || return 1
		if timeout "$((left < 5 ? left : 5))" getent ahosts "$name" >/dev/null 2>&1; then
			((n == 1)) || log "DNS: $name resolves after $n look-ups"
			return 0
		fi
		((n > 1)) || log "DNS: $name does not resolve yet, waiting up to $2 s"
		sleep "$(((end - SECONDS) < 2 ? 1 : 2))"
	done
}

# backoff ATTEMPT LEFT: exponential (1, 2, 4 ... 30 s), minus up to half as jitter, and never
# more than the time left minus a second (the last attempt starts before the deadline).
backoff() {
	local b=$((1 << ($1 < 5 ? $1 - 1 : 5)))
	((b <= 30)) || b=30
	b=$((b - RANDOM % (b / 2 + 1)))
	((b >= 1)) || b=1
	((b < $2 - 1)) || b=$(($2 - 1))
	((b >= 0)) || b=0
	printf '%s\n' "$b"
}

# curl_url_config URL: the URL as one line of a curl config file (`url = "..."`, with \ and "
# escaped as that format wants), for `curl -K -`.
curl_url_config() {
	local u=${1//\\/\\\\}
	u=${u//\"/\\\"}
	printf 'url = "%s"\n' "$u"
}

FETCH_RC=0
FETCH_REASON=""
# download URL OUT [SHA256]: curl with its own retries (--retry-all-errors) inside an outer loop
# that first waits for the host to resolve; until DOWNLOAD_DEADLINE. Writes fetch lines (the
# first failure, then one per SERIAL_EVERY s, always the outcome). Sets FETCH_RC/FETCH_REASON:
# 0 ok, 69 refused (HTTP 4xx), 65 checksum mismatch, 75 gave up at the deadline.
download() {
	local url=$1 out=$2 sha=${3:-} host t0=$SECONDS end att=0 rc code left last_line=-1 supp=0
	local err="" part="$2.part.$$" wait shown
	end=$((SECONDS + DOWNLOAD_DEADLINE))
	shown=$(shown_url "$url")
	host=$(url_host "$url") || {
		FETCH_RC=64 FETCH_REASON="not a URL: $shown"
		return 1
	}
	mkdir -p "$(dirname "$out")"
	while :; do
		att=$((att + 1))
		left=$((end - SECONDS))
		if ((left <= 0)); then
			FETCH_RC=75
			FETCH_REASON="gave up after $((att - 1)) attempts in $((SECONDS - t0))s, last error: $err"
			break
		fi
		if ! wait_dns "$host" "$((left < 5 ? left : 5))"; then
			err="dns: $host does not resolve"
		else
			left=$((end - SECONDS))
			((left > 0)) || left=1
			rc=0
			# The URL goes to curl as a config on stdin, never as an argument: a command
			# line is readable by every local user (/proc/PID/cmdline) while it runs, and
			# the URL may carry user:TOKEN@ or a signature.
			code=$(curl_url_config "$url" | curl -sS -L --retry 5 --retry-all-errors \
				--retry-max-time "$left" --connect-timeout 10 --max-time "$left" \
				-o "$part" -w '%{http_code}' -K -) || rc=$?
			if ((rc == 0)) && [[ $code == 2* ]]; then
				if [[ -n $sha ]] && ! echo "${sha,,}  $part" | sha256sum -c --status -; then
					rm -f "$part"
					FETCH_RC=65 FETCH_REASON="sha256 mismatch for $shown"
					break
				fi
				mv -f "$part" "$out"
				FETCH_RC=0 FETCH_REASON="$shown in $((SECONDS - t0))s after $att attempt(s)"
				break
			fi
			rm -f "$part"
			if ((rc == 0)) && [[ $code == 4* && $code != 408 && $code != 429 ]]; then
				FETCH_RC=69 FETCH_REASON="HTTP $code for $shown"
				break
			fi
			err="curl rc=$rc http=$code"
		fi
		left=$((end - SECONDS))
		wait=$(backoff "$att" "$left")
		log "download $shown: attempt $att failed ($err); retrying in ${wait}s"
		if ((last_line < 0 || SECONDS - last_line >= SERIAL_EVERY)); then
			emit fetch out=retry "att=$att" "host=${host:0:40}" "err=${err%%:*}" \
				"wait=$((wait * 1000))ms" "supp=$supp" -- "$err"
			last_line=$SECONDS supp=0
		else
			supp=$((supp + 1))
		fi
		sleep "$wait"
	done
	rm -f "$part"
	local out_word=ok
	case $FETCH_RC in 0) ;; 65) out_word=checksum ;; 69) out_word=refused ;; *) out_word=gave_up ;; esac
	emit fetch "out=$out_word" "att=$att" "host=${host:0:40}" "dst=$(basename "$out")" \
		"rc=$FETCH_RC" "dur=$((SECONDS - t0))" "supp=$supp" -- "$FETCH_REASON"
	((FETCH_RC == 0))
}

# md_get KEY VAR [DEFAULT]: the instance attribute KEY into variable VAR (DEFAULT when the
# attribute does not exist). The metadata server is local and needs no DNS; not getting an answer
# within METADATA_DEADLINE fails the start-up (step metadata).
md_get() {
	local key=$1 var=$2 code rc=0 tmp
	printf -v "$var" '%s' "${3:-}"
	tmp=$(mktemp)
	code=$(curl -sS --retry 20 --retry-all-errors --retry-max-time "$METADATA_DEADLINE" \
		--connect-timeout 5 --max-time 30 -H 'Metadata-Flavor: Google' -o "$tmp" \
		-w '%{http_code}' "$METADATA_URL/instance/attributes/$key") || rc=$?
	if ((rc == 0)) && [[ $code == 200 ]]; then
		printf -v "$var" '%s' "$(<"$tmp")"
	fi
	rm -f "$tmp"
	if ((rc != 0)) || [[ $code != 200 && $code != 404 ]]; then
		fail metadata "cannot read attribute $key from $METADATA_URL (curl rc=$rc, http=$code)" 75 infra
	fi
}

# json_argvs JSON KIND DIR: validate a JSON argv (KIND=argv) or a list of argvs (KIND=steps) and
# write each argv NUL-separated to DIR/0, DIR/1, ...; a message on stderr and rc 1 when invalid.
json_argvs() {
	"$PYTHON" - "$@" <<'PY'
import json, os, sys
raw, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
def argv_ok(a):
    return isinstance(a, list) and a and all(isinstance(x, str) and x and "\0" not in x for x in a)
try:
    v = json.loads(raw)
except ValueError as e:
    sys.exit("not valid JSON: %s" % e)
lists = [v] if kind == "argv" else v
if not isinstance(lists, list) or not all(argv_ok(a) for a in lists):
    want = "a JSON list of strings" if kind == "argv" else "a JSON list of lists of strings"
    sys.exit("must be %s (an argv, never a shell string)" % want)
for i, a in enumerate(lists):
    with open(os.path.join(out, "%03d" % i), "wb") as f:
        f.write(b"\0".join(x.encode() for x in a) + b"\0")
PY
}

# ---- steps -------------------------------------------------------------------------------------
# fetch_cause RC: the cause of a failed download: gave up at the deadline (75: DNS, network, the
# source never answered) is infra; refused (a 4xx), a checksum mismatch or a bad URL is the job's.
fetch_cause() { if (($1 == 75)); then echo infra; else echo job; fi; }

# sha_ok NAME VALUE: VALUE is 64 hex digits, else the install fails as a job error.
sha_ok() {
	[[ $2 =~ ^[0-9a-fA-F]{64}$ ]] ||
		fail install "$1 must be the 64-hex-digit sha256 of the file (a pinned source is required)" 64
}

# install_deb: the .deb at DEB_URL, checked against DEB_SHA256, with dpkg (its dependencies,
# python3, are on every Debian image). The package brings its own venv, unit and default config.
install_deb() {
	local file
	file="$CACHE_DIR/gce-watchdog.deb"
	download "$DEB_URL" "$file" "$DEB_SHA256" ||
		fail install "$FETCH_REASON" "$FETCH_RC" "$(fetch_cause "$FETCH_RC")"
	DEBIAN_FRONTEND=noninteractive "$DPKG" -i --force-confold "$file" >&2 ||
		fail install "dpkg -i of the downloaded package failed" $?
}

# install_wheelhouse: the tar at WHEEL_URL, checked against WHEEL_SHA256, into a fresh venv with
# no index at all: the dependencies from the wheelhouse's requirements.lock (--require-hashes),
# then the agent's own wheel (covered by the tar's sha256) without dependencies.
install_wheelhouse() {
	local file wh lock
	case "$(shown_url "$WHEEL_URL")" in
	*.tar.gz | *.tgz | *.tar) ;;
	*) fail install "gce-watchdog-wheel-url must be a wheelhouse (.tar, .tar.gz, .tgz) holding requirements.lock: a lone wheel would need its dependencies from an index" 64 ;;
	esac
	file="$CACHE_DIR/wheelhouse.tar"
	download "$WHEEL_URL" "$file" "$WHEEL_SHA256" ||
		fail install "$FETCH_REASON" "$FETCH_RC" "$(fetch_cause "$FETCH_RC")"
	wh="$CACHE_DIR/wheelhouse"
	rm -rf "$wh"
	mkdir -p "$wh"
	tar -xf "$file" -C "$wh" || fail install "cannot unpack the wheelhouse" $?
	lock=$(find "$wh" -name requirements.lock -type f -print -quit)
	[[ -n $lock ]] || fail install "the wheelhouse has no requirements.lock (dependencies pinned by hash)" 65
	# The lock names the Pythons it has wheels for (packaging/lock.sh): refuse any other before
	# the venv is made (Ubuntu 22.04's python3 is 3.10: docs/packaging.md).
	local want have
	want=$(sed -n 's/^# python: //p' "$lock")
	have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
		fail install "no $PYTHON to make the agent's venv with (the image needs python3)" 65
	[[ -z $want || " $want " == *" $have "* ]] ||
		fail install "$PYTHON is Python $have; the wheelhouse is for CPython $want (gce-watchdog needs one of those)" 65
	"$PYTHON" -m venv --clear "$PREFIX" >&2 || fail install "cannot create a venv at $PREFIX" $?
	# --isolated: no PIP_* variables or pip.conf (an index URL there must not matter).
	local pip=("$PREFIX/bin/python" -m pip --isolated install --disable-pip-version-check
		--no-input -q --no-index --find-links "$(dirname "$lock")")
	if grep -q '^[A-Za-z0-9]' "$lock"; then
		"${pip[@]}" --require-hashes --only-binary=:all: -r "$lock" >&2 ||
			fail install "pip install --require-hashes from the wheelhouse's requirements.lock failed" $?
	fi
	local agent_whl
	agent_whl=$(find "$(dirname "$lock")" -maxdepth 1 -name 'gce_watchdog-*.whl' -print -quit)
	[[ -n $agent_whl ]] || fail install "the wheelhouse has no gce_watchdog-*.whl beside requirements.lock" 65
	"${pip[@]}" --no-deps "$agent_whl" >&2 || fail install "pip install of the agent's wheel failed" $?
}

install_agent() {
	STEP=install
	local t0=$SECONDS src shown
	if have_agent && [[ -f $PREFIX/.baked ]]; then
		step_done install ok "$t0" "baked into the image at $PREFIX"
		return 0
	fi
	# What is installed is named by its sha256 (never the URL, which may carry a credential).
	if [[ -n $DEB_URL ]]; then
		sha_ok gce-watchdog-deb-sha256 "$DEB_SHA256"
		src="deb sha256:${DEB_SHA256,,}" shown=$(shown_url "$DEB_URL")
	elif [[ -n $WHEEL_URL ]]; then
		sha_ok gce-watchdog-wheel-sha256 "$WHEEL_SHA256"
		src="wheelhouse sha256:${WHEEL_SHA256,,}" shown=$(shown_url "$WHEEL_URL")
	else
		# Never a package index: whoever registers the name there would get root on every VM.
		fail install "no agent source: bake the image (bake-image.sh), or set gce-watchdog-deb-url and gce-watchdog-deb-sha256, or gce-watchdog-wheel-url and gce-watchdog-wheel-sha256" 78
	fi
	if have_agent && [[ -f $PREFIX/.installed-from && "$(head -n1 "$PREFIX/.installed-from")" == "$src" ]]; then
		step_done install ok "$t0" "already installed from $shown"
		return 0
	fi
	rm -f "$PREFIX/.installed-from"
	if [[ -n $DEB_URL ]]; then install_deb; else install_wheelhouse; fi
	have_agent || fail install "$AGENT does not run after the install" 1
	(
		umask 077
		printf '%s\n%s\n' "$src" "$shown" >"$PREFIX/.installed-from"
	)
	step_done install ok "$t0" "installed from $shown"
}

# apply_md_config: the gce-watchdog-config attribute (TOML) becomes the drop-in MD_DROPIN, after
# `gce-watchdog config check` accepted the merged result with it (config.toml, the other
# drop-ins, this one). The value only ever goes into a file: never into a shell command line.
# A bad value fails the step (the check's rc, cause=job) with the check's errors on the console;
# the agent never starts with it, nor silently with the defaults instead. Without the attribute
# a drop-in left by an earlier boot is removed: the attribute owns that file.
apply_md_config() {
	STEP=config
	local t0=$SECONDS dir tmp cand out rc=0 first new
	dir=$(dirname "$MD_DROPIN")
	if [[ -z $MD_CONFIG ]]; then
		if [[ -e $MD_DROPIN || -L $MD_DROPIN ]]; then
			rm -f "$MD_DROPIN"
			note_restart
			step_done config ok "$t0" "no gce-watchdog-config attribute: removed $(basename "$MD_DROPIN")"
		fi
		return 0
	fi
	if [[ ! -e $CONFIG ]]; then
		# The drop-in is read beside the config file; an empty one is the defaults.
		mkdir -p "$(dirname "$CONFIG")"
		printf '# gce-watchdog: the defaults (the start-up script made this file for %s)\n' \
			"$(basename "$MD_DROPIN")" >"$CONFIG"
	fi
	CFG_ARGS=(--config "$CONFIG")
	tmp=$(mktemp -d) # 0700: only root reads the candidate
	cand="$tmp/$(basename "$MD_DROPIN")"
	printf '%s\n' "$MD_CONFIG" >"$cand"
	out=$("$AGENT" config check --config "$CONFIG" --drop-in "$cand" 2>&1 9>&-) || rc=$?
	out=${out//"$cand"/gce-watchdog-config}
	rm -rf "$tmp"
	if ((rc != 0)); then
		log "the gce-watchdog-config attribute is refused by gce-watchdog config check (rc=$rc):"
		printf '%s\n' "$out" >&2
		# The serial line has room for ~30 bytes of text: the first error, key path first (the
		# step says it is the attribute; every error is on stderr above).
		first=$(printf '%s\n' "$out" | sed -n 's/^  - \(gce-watchdog-config: \)\{0,1\}//p' | head -n1)
		[[ -n $first ]] || first=$(printf '%s\n' "$out" | head -n1)
		fail config "${first:-gce-watchdog-config: config check failed}" "$rc"
	fi
	mkdir -p "$dir" || fail config "cannot create $dir" 73
	# mktemp: a new file (O_EXCL, never through a planted link), mode 0600; a dot name, which
	# the agent never reads; then one rename, so the agent reads the old file or the new one.
	new=$(mktemp "$dir/.$(basename "$MD_DROPIN").XXXXXX") || fail config "cannot write in $dir" 73
	if ! { printf '%s\n' "$MD_CONFIG" >"$new" && sync "$new"; }; then
		rm -f "$new"
		fail config "cannot write $MD_DROPIN" 73
	fi
	if cmp -s "$new" "$MD_DROPIN"; then
		rm -f "$new"
		step_done config ok "$t0" "gce-watchdog-config unchanged in $(basename "$MD_DROPIN")"
		return 0
	fi
	mv -f -T "$new" "$MD_DROPIN" || { rm -f "$new"; fail config "cannot write $MD_DROPIN" 73; }
	note_restart
	step_done config ok "$t0" "gce-watchdog-config checked and written to $(basename "$MD_DROPIN")"
}

# note_restart: the drop-in changed; an agent that is already running (the .deb's postinst
# started it, or this is a later boot) read the old one and restarts in the unit step. One that
# is not running yet reads the new one when the unit step starts it.
note_restart() {
	if [[ -d $SYSTEMD_RUN_DIR ]] && command -v systemctl >/dev/null &&
		systemctl is-active --quiet gce-watchdog.service 9>&-; then
		RESTART_AGENT=1
	fi
}

# restart_if_changed: an agent that was running when the drop-in changed restarts to read it.
restart_if_changed() {
	((RESTART_AGENT)) || return 0
	systemctl try-restart gce-watchdog.service >&2 9>&- ||
		fail unit "systemctl try-restart gce-watchdog.service failed (to read the new config)" $?
}

install_unit() {
	STEP=unit
	local t0=$SECONDS
	if [[ ! -d $SYSTEMD_RUN_DIR ]] || ! command -v systemctl >/dev/null; then
		step_done unit skip "$t0" "systemd is not running"
		return 0
	fi
	# The .deb's unit: /usr/lib/systemd/system (/lib on a system without merged /usr, older builds).
	if [[ (-f $ROOT/usr/lib/systemd/system/gce-watchdog.service || -f $ROOT/lib/systemd/system/gce-watchdog.service) &&
		! -f $ROOT/etc/systemd/system/gce-watchdog.service ]]; then
		# The .deb's unit: its postinst enabled and started it; make sure it runs.
		systemctl enable --now gce-watchdog.service >&2 9>&- ||
			fail unit "systemctl enable --now gce-watchdog.service failed" $?
		restart_if_changed
		step_done unit ok "$t0" "packaged unit enabled and started"
		return 0
	fi
	if ! "$AGENT" install --help >/dev/null 2>&1; then
		step_done unit skip "$t0" "this agent has no install command"
		return 0
	fi
	# install's --config is the path as the agent sees it (install itself honours GCEWD_ROOT);
	# it writes a default config there when none exists.
	# --exec: the agent's path as the unit will see it (under the root, not this script's view).
	"$AGENT" install --config "${CONFIG#"$ROOT"}" --exec "${AGENT#"$ROOT"}" >&2 9>&- ||
		fail unit "gce-watchdog install failed" $?
	restart_if_changed
	step_done unit ok "$t0" "systemd unit installed and started"
}

run_steps() { # DIR LABEL: every argv file in DIR, in order, as a bootstrap step
	local dir=$1 label=$2 f argv rc t0 name
	for f in "$dir"/*; do
		[[ -f $f ]] || continue
		mapfile -d '' -t argv <"$f"
		name="$label$(basename "$f")"
		STEP="bootstrap:$name"
		t0=$SECONDS
		# The program only: arguments may carry credentials, and this goes to the console.
		log "bootstrap step $name: $(basename -- "${argv[0]}")"
		rc=0
		timeout "$STEP_TIMEOUT" "${argv[@]}" >&2 9>&- || rc=$?
		if ((rc == 124)); then
			fail "bootstrap:$name" "timed out after ${STEP_TIMEOUT}s: $(basename -- "${argv[0]}")" 124
		elif ((rc == 75)); then
			# EX_TEMPFAIL: what `gce-watchdog fetch` exits when it gave up at its deadline (the
			# network or the source never came up): not the job's fault.
			fail "bootstrap:$name" "$(basename -- "${argv[0]}") gave up (rc 75, EX_TEMPFAIL)" 75 infra
		elif ((rc == 6 || rc == 7 || rc == 28)); then
			# curl's "could not resolve host", "failed to connect", "operation timed out" (curl(1),
			# EXIT CODES): a raw download failed on the network after the metadata and DNS checks
			# passed; the same failure through `gce-watchdog fetch` is 75 and infra (issue 36.4).
			fail "bootstrap:$name" "$(basename -- "${argv[0]}") exited with $rc (curl: network)" "$rc" infra
		elif ((rc != 0)); then
			fail "bootstrap:$name" "$(basename -- "${argv[0]}") exited with $rc" "$rc"
		fi
		step_done "bootstrap:$name" ok "$t0"
	done
}

# The bootstrap's scratch folder: removed by the EXIT trap as well, since a failed step ends the
# script (fail -> exit) before run_bootstrap's own rm -rf.
BOOT_TMP=""
remove_scratch() { [[ -z $BOOT_TMP ]] || rm -rf -- "$BOOT_TMP"; }

run_bootstrap() {
	STEP=bootstrap
	local tmp f n=0
	tmp=$(mktemp -d)
	BOOT_TMP=$tmp
	export PATH="$PREFIX/bin:$PATH" GCEWD_STATE_DIR="$STATE_DIR" GCEWD_CONFIG="$CONFIG"
	# 1. files baked into the image: executables in BOOTSTRAP_DIR, in name order (run-parts
	#    rules: no dotfiles, no editor backups or package manager leftovers).
	mkdir -p "$tmp/dir"
	if [[ -d $BOOTSTRAP_DIR ]]; then
		for f in "$BOOTSTRAP_DIR"/*; do
			case "$(basename "$f")" in .* | *~ | *.dpkg-* | *.rpm* | *.disabled) continue ;; esac
			[[ -f $f && -x $f ]] || continue
			printf '%s\0' "$f" >"$tmp/dir/$(basename "$f")"
			n=$((n + 1))
		done
	fi
	run_steps "$tmp/dir" ""
	# 2. the gce-watchdog-bootstrap attribute: a JSON list of argvs, e.g.
	#    [["apt-get", "install", "-y", "git"], ["/opt/job/setup", "--fast"]]
	STEP=bootstrap
	mkdir -p "$tmp/md"
	if [[ -n $MD_BOOTSTRAP ]]; then
		local msg
		msg=$(json_argvs "$MD_BOOTSTRAP" steps "$tmp/md" 2>&1) ||
			fail bootstrap "gce-watchdog-bootstrap: $msg" 64
		n=$((n + $(find "$tmp/md" -type f | wc -l)))
	fi
	run_steps "$tmp/md" "md"
	rm -rf "$tmp"
	BOOT_TMP=""
	STEP=bootstrap
	((n > 0)) || log "no bootstrap steps"
}

main() {
	if [[ ${1:-} == emit ]]; then
		shift
		emit "$@"
		return 0
	fi
	trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR
	trap remove_scratch EXIT
	mkdir -p "$STATE_DIR"
	# One start-up at a time (the runner, and an operator re-running it by hand).
	exec 9>>"$STATE_DIR/startup.lock"
	if ! flock -n 9; then
		log "another start-up script run holds $STATE_DIR/startup.lock; leaving it alone"
		return 0
	fi
	if [[ -f $CONFIG ]]; then CFG_ARGS=(--config "$CONFIG"); fi
	FAIL_NOTE=$STATE_DIR/.startup-failure
	rm -f "$FAIL_NOTE"

	STEP=bootstrap
	phase bootstrap
	log "bootstrap: prefix=$PREFIX state=$STATE_DIR metadata=$METADATA_URL"

	STEP=metadata
	md_get gce-watchdog-failure-action MD_FAILURE_ACTION
	md_get gce-watchdog-deb-url DEB_URL
	md_get gce-watchdog-deb-sha256 DEB_SHA256
	md_get gce-watchdog-wheel-url WHEEL_URL
	md_get gce-watchdog-wheel-sha256 WHEEL_SHA256
	md_get gce-watchdog-bootstrap MD_BOOTSTRAP
	md_get gce-watchdog-workload MD_WORKLOAD
	md_get gce-watchdog-dns-name MD_DNS_NAME
	md_get gce-watchdog-config MD_CONFIG
	md_get gce-watchdog-done-action DONE_ACTION none
	DONE_ACTION="${GCEWD_DONE_ACTION:-$DONE_ACTION}"
	md_get gce-watchdog-linger MD_LINGER
	md_get gce-watchdog-expect-result MD_EXPECT_RESULT

	STEP=dns
	local t0=$SECONDS dns_name="" src_url
	if [[ -n ${GCEWD_DNS_NAME+set} ]]; then
		dns_name=$GCEWD_DNS_NAME
	elif [[ -n $MD_DNS_NAME ]]; then
		dns_name=$MD_DNS_NAME
	else
		src_url=${DEB_URL:-$WHEEL_URL}
		if [[ -n $src_url ]]; then dns_name=$(url_host "$src_url") || dns_name=""; fi
	fi
	if [[ -z $dns_name ]]; then
		step_done dns skip "$t0" "no name to wait for (no package URL, no gce-watchdog-dns-name)"
	else
		wait_dns "$dns_name" "$DNS_DEADLINE" ||
			fail dns "$dns_name did not resolve within ${DNS_DEADLINE}s" 75 infra
		step_done dns ok "$t0" "$dns_name resolves"
	fi

	install_agent
	apply_md_config
	install_unit
	run_bootstrap

	STEP=workload
	if [[ -z $MD_WORKLOAD ]]; then
		step_done workload skip "$SECONDS" "no gce-watchdog-workload attribute; run the job under gce-watchdog exec"
		return 0
	fi
	local wdir msg rc=0 exec_args=()
	case "${MD_EXPECT_RESULT,,}" in true | 1 | yes | on) exec_args=(--expect-result) ;; esac
	wdir=$(mktemp -d)
	msg=$(json_argvs "$MD_WORKLOAD" argv "$wdir" 2>&1) || fail workload "gce-watchdog-workload: $msg" 64
	mapfile -d '' -t WORKLOAD <"$wdir/000"
	rm -rf "$wdir"
	trap - ERR
	# From here on the job runs: its failure is an `exit` line (the job's result), not setup_failed.
	"$AGENT" exec "${CFG_ARGS[@]}" "${exec_args[@]}" -- "${WORKLOAD[@]}" 9>&- || rc=$?
	# exec records phase `workload` before it starts the job. If it is not there, exec refused to
	# run (bad config, usage): the job never ran, so this is a setup failure, never `done`.
	if [[ "$(cat "$STATE_DIR/phase" 2>/dev/null)" != workload ]]; then
		fail workload "gce-watchdog exec did not start the workload (rc=$rc)" "$((rc ? rc : 1))"
	fi
	phase "done"
	case "${DONE_ACTION:-none}" in
	none) ;;
	poweroff) if ((rc == 0)); then end_vm "done"; else end_vm failed; fi ;;
	reboot) "$ACTION_CMD" reboot || log "done action failed: rc=$?" ;;
	*) log "unknown gce-watchdog-done-action '$DONE_ACTION' (want none, poweroff or reboot)" ;;
	esac
	return "$rc"
}

# Sourced (the tests do, to reach single functions), it only defines them.
# (`return` works only in a sourced file: run as a file, from stdin or with -c, main runs.)
(return 0 2>/dev/null) || main "$@"
