# gce-watchdog: every target sets up what it needs, so on a fresh Debian machine as root
# `make demo` and `make test` are the only two commands needed.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
# Packages the tests use for real parts: network namespaces, iptables, systemd-analyze, shellcheck;
# nginx and openssl: fetch against a real web server (HTTP and HTTPS with a CA made by the test);
# lintian: make deb's package has no lintian errors (tests/root/test_deb.py);
# debootstrap: the Debian 12 and 13 trees the packages are built and installed in
# faketime: a second build of the man pages and .debs on another day gives the same bytes
# (tests/root/test_deb_releases.py; cached under build/cache/debroot);
# postgresql: the ledger's contract suite (tests/kit/pgserver.py runs its own initdb and pg_ctl in a
# temp dir on a loopback port);
# chromium: the HTML report's colours, seen in a real browser (tests/integration/test_report_browser.py).
# The tests start their own servers from temp configs; the packages' own services are never
# started (policy-rc.d during the install) and disabled afterwards.
APT_TEST := iptables iproute2 systemd procps shellcheck nginx openssl postgresql lintian debootstrap \
  podman runc chromium faketime

.PHONY: demo test test-fast lint venv apt-test install install-cli bench bench-deps bench-peers \
  e2e e2e-if-possible clean \
  cli-docs deb dev-lock

$(VENV)/bin/python:
	@$(PY) -m venv --help >/dev/null 2>&1 && $(PY) -c 'import ensurepip' 2>/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv; }
	$(PY) -m venv $(VENV)

# The dev toolchain under packaging/constraints-dev.txt (exact versions: a clean clone tests with
# what this tree last passed with; `make dev-lock` moves them to PyPI's newest).
DEV_CONSTRAINTS := packaging/constraints-dev.txt
$(STAMP): pyproject.toml $(DEV_CONSTRAINTS) $(VENV)/bin/python
	$(VPY) -m pip install -q --upgrade pip >/dev/null
	$(VPY) -m pip install -q -e '.[dev,report]' -c $(DEV_CONSTRAINTS)
	touch $@

venv: $(STAMP)

# The newest versions of the dev toolchain into DEV_CONSTRAINTS (needs PyPI): a fresh venv,
# `.[dev,report]` unconstrained, pip freeze under the file's own header. Run make test after.
dev-lock: $(VENV)/bin/python
	rm -rf build/dev-lock && $(PY) -m venv build/dev-lock
	build/dev-lock/bin/python -m pip install -q --upgrade pip >/dev/null
	build/dev-lock/bin/python -m pip install -q -e '.[dev,report]'
	{ sed -n '/^#/p' $(DEV_CONSTRAINTS); build/dev-lock/bin/python -m pip freeze --exclude-editable; } \
	  > $(DEV_CONSTRAINTS).new && mv $(DEV_CONSTRAINTS).new $(DEV_CONSTRAINTS)
	rm -rf build/dev-lock

# `gce-watchdog` on PATH for this checkout, so the README's commands work as typed: as root a
# link CLI_LINK -> .venv/bin/gce-watchdog (/usr/local/bin is on root's and sudo's PATH on Debian);
# a file there that is not a link (someone else's) is left alone. Without root: the PATH line to
# use instead. Explicit, not part of `make venv`: several checkouts on one machine would otherwise
# take the link from each other.
CLI_LINK ?= /usr/local/bin/gce-watchdog
install-cli: $(STAMP)
	@if [ "$$(id -u)" != 0 ]; then \
	  echo "install-cli: not root; for this shell: export PATH=\"$(CURDIR)/$(VENV)/bin:\$$PATH\""; \
	elif [ -e $(CLI_LINK) ] && [ ! -L $(CLI_LINK) ]; then \
	  echo "install-cli: $(CLI_LINK) exists and is not a link: left alone" >&2; exit 1; \
	else ln -sfn $(CURDIR)/$(VENV)/bin/gce-watchdog $(CLI_LINK) && \
	  echo "install-cli: $(CLI_LINK) -> $(CURDIR)/$(VENV)/bin/gce-watchdog"; fi

# Installs the apt packages the tests need when running as root and one is missing.
apt-test:
	@missing=""; for p in $(APT_TEST); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "apt-get install$$missing"; \
	    guard=""; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
	      chmod 755 /usr/sbin/policy-rc.d; guard=1; }; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing; rc=$$?; \
	    [ -z "$$guard" ] || rm -f /usr/sbin/policy-rc.d; \
	    case " $$missing " in *" nginx "*) systemctl disable nginx.service >/dev/null 2>&1 || \
	      update-rc.d nginx disable >/dev/null 2>&1 || true;; esac; \
	    case " $$missing " in *" postgresql "*) systemctl disable postgresql.service >/dev/null 2>&1 || \
	      update-rc.d postgresql disable >/dev/null 2>&1 || true;; esac; [ $$rc = 0 ]; \
	  else echo "not root: cannot install$$missing (those tests will skip)"; fi; \
	fi

demo: $(STAMP)
	$(VPY) -m gce_watchdog.testing.demo

test: $(STAMP) apt-test
	@# The VM scenarios (make e2e) start first and run beside the linters and pytest: they are
	@# the long pole (their image and wheelhouse take minutes before the first boot), and both
	@# stages spend most of their time waiting (a guest's ticks, a worker's deadline), so side by
	@# side they take about as long as the longer one (docs/e2e.md, "Time"). Their output goes
	@# to build/e2e-stage.log and is shown once pytest ends, then live until the scenarios end.
	@# A linter's failure fails make test once every stage has run (each stage's result is said).
	@mkdir -p build && rm -f build/e2e-stage.log build/e2e-stage.rc && : >build/e2e-stage.log; \
	( $(MAKE) --no-print-directory e2e-if-possible >build/e2e-stage.log 2>&1; \
	  echo $$? >build/e2e-stage.rc ) & e2e=$$!; \
	echo "make test: the VM scenarios run beside the linters and pytest (pid $$e2e, build/e2e-stage.log)"; \
	lrc=0; \
	$(VENV)/bin/ruff check agent tests bench tools || lrc=1; \
	$(VENV)/bin/ruff format --check agent tests bench e2e tools || lrc=1; \
	$(VENV)/bin/mypy || lrc=1; \
	MYPYPATH=tests $(VENV)/bin/mypy --strict tests/kit || lrc=1; \
	$(VENV)/bin/lint-imports || lrc=1; \
	HYPOTHESIS_PROFILE=ci $(VENV)/bin/pytest -q -p no:cacheprovider --durations=25; rc=$$?; \
	echo "make test: pytest rc=$$rc; the VM scenarios' output:"; \
	tail -n +1 -f --pid=$$e2e build/e2e-stage.log; wait $$e2e; \
	erc=$$(cat build/e2e-stage.rc 2>/dev/null || echo 1); \
	echo "make test: linters rc=$$lrc, pytest rc=$$rc, VM scenarios rc=$$erc"; \
	[ "$$lrc" = 0 ] && [ "$$rc" = 0 ] && [ "$$erc" = 0 ]

# The fast loop (docs/development.md, "Tiers"): every test marked pure, wherever its file is (no
# process, server, socket, blocking clock or namespace; tests/conftest.py checks the first two
# while they run). `make test` runs every tier (pytest over tests/).
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m pure tests

# The same checks as make test's linters (ruff is pinned in packaging/constraints-dev.txt, so its
# formatter's style cannot change under code that did not: make test checks the format too).
lint: $(STAMP)
	$(VENV)/bin/ruff check agent tests bench tools
	$(VENV)/bin/ruff format --check agent tests bench e2e tools
	$(VENV)/bin/mypy
	MYPYPATH=tests $(VENV)/bin/mypy --strict tests/kit
	$(VENV)/bin/lint-imports

# Benchmarks (docs/performance.md): the agent vs monit and watchdog(8) in network namespaces.
# BENCH_ARGS: --quick (about 2 min), --no-peers, --no-doc, --load N. The peers are installed as root
# when missing (bench-deps), with service starts blocked (policy-rc.d) and their boot units disabled
# afterwards: the benchmark runs them itself, from temp configs, and never needs them as services.
APT_BENCH := monit watchdog curl util-linux
BENCH_ARGS ?=
FLEET_ARGS ?=
BENCH_SYSPY ?= /usr/bin/python3
bench-deps: $(STAMP) apt-test
	@missing=""; for p in $(APT_BENCH); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "apt-get install$$missing"; \
	    guard=""; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
	      chmod 755 /usr/sbin/policy-rc.d; guard=1; }; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing; rc=$$?; \
	    [ -z "$$guard" ] || rm -f /usr/sbin/policy-rc.d; \
	    for u in monit watchdog; do case " $$missing " in *" $$u "*) \
	      systemctl disable $$u.service >/dev/null 2>&1 || update-rc.d $$u disable >/dev/null 2>&1 || true;; \
	    esac; done; [ $$rc = 0 ]; \
	  else echo "not root: cannot install$$missing (the peers are skipped)"; fi; \
	fi
# The whole benchmark, every section (about 17 minutes on 2 cores), the docs' tables regenerated.
bench: bench-deps
	@# The agent as shipped: a venv from the system's python3 (what the start-up script uses on a
	@# Debian VM) with the start-up script's install: the dependencies pinned by hash in
	@# packaging/requirements.lock (the GPU library nvidia-ml-py among them, as on every VM), then a
	@# wheel install of this checkout, rebuilt every run so it is current.
	@if [ -x $(BENCH_SYSPY) ]; then rm -rf .bench-venv && $(BENCH_SYSPY) -m venv --without-pip .bench-venv \
	  && $(VPY) -m pip --python .bench-venv/bin/python install -q --disable-pip-version-check \
	       --require-hashes --only-binary=:all: -r packaging/requirements.lock \
	  && $(VPY) -m pip --python .bench-venv/bin/python install -q --disable-pip-version-check --no-deps . \
	  || { echo "cannot build .bench-venv (the as-shipped rows are skipped)"; rm -rf .bench-venv; }; \
	else echo "no $(BENCH_SYSPY): the as-shipped rows are skipped"; fi
	@# The last section is the central side at fleet scale (bench/bench_fleet.py): polling 1,000
	@# and 5,000 simulated VMs, and the Pub/Sub path on the emulator at 1,200 messages/s; its
	@# figures are targets of the same run. FLEET_ARGS: more of its arguments, e.g. --sizes 1000.
	$(VPY) -m bench.run $(BENCH_ARGS) --fleet-args "$(FLEET_ARGS)"

# The side-by-side detection alone (issue 38 item 7, about 10 minutes): every watcher (the agent
# at timeout/interval 0.5, 0.9 and 0.99, monit, watchdog(8)) against the same fault, quiet, then
# with 2 busy processes per core; merged into the committed run's results (PEERS_OUT, whose other
# sections stay as they were, so every other table is regenerated unchanged) and the docs' tables.
# `make bench` runs the same two sections among the others.
PEERS_OUT ?= docs/bench-results.json
bench-peers: bench-deps
	$(VPY) -m bench.run --only-detection --out $(PEERS_OUT) $(BENCH_ARGS)

# The Debian packages (docs/packaging.md), one per release in DEB_RELEASES:
# build/deb/gce-watchdog_<version>-1~deb12u1_amd64.deb (bookworm) and ~deb13u1 (trixie), each a
# self-contained venv (and gce-watchdog-poller_*: the poller's unit and its PostgreSQL and Pub/Sub
# libraries, added to that venv) under /opt/gce-watchdog made in a debootstrap tree of that release with its
# own python3 (packaging/debroot.sh, cached under build/: ~1.5 min per release the first time),
# from the wheels pinned by hash in packaging/requirements.lock (downloaded once into
# build/cache), reproducible; then lintian must report no errors (installed as root when missing).
# Needs root (debootstrap, chroot).
DEB_RELEASES ?= bookworm trixie
deb: $(STAMP) cli-docs
	@command -v debootstrap >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap; }
	@for r in $(DEB_RELEASES); do t0=$$(date +%s); \
	  GCEWD_CLI_DOCS=$(CLI_DOCS) packaging/build-deb.sh build/deb $$r || exit 1; \
	  echo "deb: $$r in $$(( $$(date +%s) - t0 ))s"; done
	@command -v lintian >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends lintian; } || \
	  echo "deb: lintian missing and not root: not checked"
	@# lintian leaves an MLDBM file in $$TMPDIR after each run: a folder of its own, removed
	! command -v lintian >/dev/null || { t=$$(mktemp -d) && rc=0 && TMPDIR=$$t lintian --fail-on error \
	  build/deb/gce-watchdog_*_amd64.deb build/deb/gce-watchdog-poller_*_amd64.deb || rc=$$?; \
	  rm -rf "$$t"; exit $$rc; }

# Installs the agent from this checkout into the venv the start-up script uses ($(PREFIX)), then
# lays down the systemd unit and a default config, enables and starts it (idempotent; run as root).
# INSTALL_FLAGS: e.g. --no-start. (Not --root DIR: this venv's python is not in an image tree, and
# install refuses it; an image gets the agent from `startup/bake-image.sh --root DIR`.)
PREFIX ?= /opt/gce-watchdog
INSTALL_FLAGS ?=
install:
	$(PY) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip install -q --disable-pip-version-check --upgrade .
	$(PREFIX)/bin/gce-watchdog install $(INSTALL_FLAGS)

# VM end-to-end scenarios (docs/e2e.md): a Debian guest under qemu (TCG) with a simulated GCE,
# one boot per scenario, in E2E_SHARDS pytest processes at once (e2e/shards.py: the tests split
# by their measured cost; each shard's output in build/e2e/shard-I.log, printed when it ends).
# Installs qemu/debootstrap as root when missing; the guest image is cached under build/e2e
# (first build ~2 min, then seconds). E2E_ARGS: pytest arguments, e.g. E2E_ARGS='-k wedge'.
# E2E_SHARDS=1: one guest at a time. E2E_KVM=1 uses /dev/kvm instead of TCG.
APT_E2E := qemu-system-x86 debootstrap e2fsprogs util-linux
E2E_ARGS ?=
E2E_SHARDS ?= 2
e2e: $(STAMP) apt-test
	@missing=""; for p in $(APT_E2E); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "e2e: not root, cannot install$$missing"; exit 1; fi; \
	  echo "apt-get install$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $$missing; \
	fi
	$(VENV)/bin/ruff check e2e
	! command -v shellcheck >/dev/null || shellcheck e2e/*.sh e2e/guest/usr/local/sbin/gce-startup-runner \
	  e2e/guest/usr/local/sbin/e2e-console-hangup e2e/guest/usr/local/sbin/e2e-console-login \
	  e2e/guest/usr/local/sbin/e2e-poller-unit
	@# its own cache: make test runs its other mypy calls at the same time
	MYPYPATH=tests $(VENV)/bin/mypy --strict --cache-dir build/.mypy-e2e e2e
	@# the image and the wheelhouse with the .deb, side by side (e2e/vm.py prepare), in a step of
	@# their own; the tests' fixture reuses them through the token
	@tok=$$$$-$$(date +%s%N); t0=$$(date +%s); \
	GCEWD_E2E_PREPARED=$$tok $(VENV)/bin/python -m e2e.vm image && \
	echo "e2e: image and wheelhouse ready in $$(( $$(date +%s) - t0 ))s" && \
	GCEWD_E2E=1 GCEWD_E2E_PREPARED=$$tok $(VENV)/bin/python -m e2e.shards $(E2E_SHARDS) \
	  -q -p no:cacheprovider -rA tests/e2e $(E2E_ARGS)

# make test's hook: the VM scenarios run when this machine can boot them (root, apt-get for qemu,
# /dev/net/tun); otherwise one line says why. GCEWD_E2E=0 skips them explicitly.
e2e-if-possible:
	@if [ "$${GCEWD_E2E:-}" = 0 ]; then echo "e2e: skipped (GCEWD_E2E=0)"; \
	elif [ "$$(id -u)" != 0 ]; then echo "e2e: skipped (needs root)"; \
	elif [ ! -e /dev/net/tun ]; then echo "e2e: skipped (no /dev/net/tun)"; \
	elif ! command -v qemu-system-x86_64 >/dev/null && ! command -v apt-get >/dev/null; then \
	  echo "e2e: skipped (no qemu and no apt-get to install it)"; \
	else $(MAKE) --no-print-directory e2e; fi

# The man pages and shell completion, generated from the argparse definitions and the config's
# dataclasses (tools/cli_docs.py; shtab and argparse-manpage are in the dev extra, never runtime
# dependencies). The .deb installs them as /usr/share/man/man1/gce-watchdog.1.gz,
# /usr/share/man/man5/gce-watchdog.toml.5.gz, /usr/share/bash-completion/completions/gce-watchdog
# and /usr/share/zsh/vendor-completions/_gce-watchdog.
CLI_DOCS := build/cli-docs
# The pages' date is SOURCE_DATE_EPOCH, by default the newest entry of the package's changelog
# (packaging/debian/changes.toml), never the build day: the output is the same on any day.
cli-docs: $(STAMP)
	@mkdir -p $(CLI_DOCS)/man1 $(CLI_DOCS)/man5 $(CLI_DOCS)/bash-completion $(CLI_DOCS)/zsh
	$(VPY) tools/cli_docs.py exit-status $(CLI_DOCS)/exit-status.include
	$(VPY) tools/cli_docs.py config-man $(CLI_DOCS)/man5/gce-watchdog.toml.5
	SOURCE_DATE_EPOCH="$${SOURCE_DATE_EPOCH:-$$($(VPY) packaging/changelog.py --epoch packaging/debian/changes.toml)}" \
	$(VENV)/bin/argparse-manpage --module gce_watchdog.cli --function build_parser \
	  --project-name gce-watchdog --prog gce-watchdog \
	  --version "$$($(VPY) -c 'import gce_watchdog; print(gce_watchdog.__version__)')" \
	  --description "in-VM watchdog agent and bootstrap toolkit for Google Compute Engine" \
	  --manual-title "gce-watchdog manual" --format single-commands-section \
	  --include $(CLI_DOCS)/exit-status.include --output $(CLI_DOCS)/man1/gce-watchdog.1
	$(VPY) tools/cli_docs.py bash-completion $(CLI_DOCS)/bash-completion/gce-watchdog
	$(VPY) tools/cli_docs.py zsh-completion $(CLI_DOCS)/zsh/_gce-watchdog
	@echo "written: $(CLI_DOCS)/man1/gce-watchdog.1 $(CLI_DOCS)/man5/gce-watchdog.toml.5 $(CLI_DOCS)/bash-completion/gce-watchdog $(CLI_DOCS)/zsh/_gce-watchdog"

clean:
	rm -rf $(VENV) .bench-venv build .pytest_cache .mypy_cache .ruff_cache
