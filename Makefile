# gce-watchdog: every target sets up what it needs, so on a fresh Debian machine as root
# `make demo` and `make test` are the only two commands needed.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
# Packages the tests use for real parts: network namespaces, iptables, systemd-analyze, shellcheck.
APT_TEST := iptables iproute2 systemd procps shellcheck

.PHONY: demo test lint venv apt-test install bench e2e clean

$(VENV)/bin/python:
	@$(PY) -m venv --help >/dev/null 2>&1 && $(PY) -c 'import ensurepip' 2>/dev/null || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv; }
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml $(VENV)/bin/python
	$(VPY) -m pip install -q --upgrade pip >/dev/null
	$(VPY) -m pip install -q -e '.[dev,report]'
	touch $@

venv: $(STAMP)

# Installs the apt packages the tests need when running as root and one is missing.
apt-test:
	@missing=""; for p in $(APT_TEST); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "apt-get install$$missing"; apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "not root: cannot install$$missing (those tests will skip)"; fi; \
	fi

demo: $(STAMP)
	$(VPY) -m agent.demo

test: $(STAMP) apt-test
	$(VENV)/bin/ruff check agent tests
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check agent tests
	$(VENV)/bin/ruff format --check agent tests || true
	$(VENV)/bin/mypy

# Installs the agent from this checkout into the venv the start-up script uses ($(PREFIX)), then
# lays down the systemd unit and a default config, enables and starts it (idempotent; run as root).
# INSTALL_FLAGS: e.g. --no-start, or --root DIR for an image tree.
PREFIX ?= /opt/gce-watchdog
INSTALL_FLAGS ?=
install:
	$(PY) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip install -q --disable-pip-version-check --upgrade .
	$(PREFIX)/bin/gce-watchdog install $(INSTALL_FLAGS)

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
