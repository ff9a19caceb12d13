# corral: `make demo` and `make test` work on a fresh Debian 12 machine as root.
SHELL := /bin/bash
PY := /usr/bin/python3
VENV := .venv
VPY := $(VENV)/bin/python
APT_PACKAGES := bubblewrap python3-venv gcc git iproute2 tmux runc crun passt nftables slirp4netns curl nodejs qemu-system-x86 linux-image-amd64 busybox-static runsc uidmap skopeo docker-registry chromium btrfs-progs
STAMP := $(VENV)/.installed

# Unprivileged test users (tests/rootless/): one with subordinate ids, one without.
ROOTLESS_USER := corral-rootless
NOSUBID_USER := corral-nosubid
ROOTLESS_SUBIDS := 100000:65536

.PHONY: setup rootless-users vendor demo test test-rootless test-microvm test-runsc lint bench clean security-report security-report-rootless

setup: $(STAMP) rootless-users vendor

# The dashboard's terminal: xterm.js (MIT) from the npm registry, pinned, unpacked into a
# git-ignored folder of the package at build time (the wheel takes it as a build artefact).
XTERM_VERSION := 6.0.0
VENDOR := src/corral/server/static/vendor
vendor: $(VENDOR)/.xterm-$(XTERM_VERSION)

$(VENDOR)/.xterm-$(XTERM_VERSION):
	rm -rf $(VENDOR) && mkdir -p $(VENDOR)/.npm
	cd $(VENDOR) && npm pack --silent --cache .npm @xterm/xterm@$(XTERM_VERSION) >/dev/null \
	  && tar xzf xterm-xterm-$(XTERM_VERSION).tgz \
	  && cp package/lib/xterm.js package/css/xterm.css . && cp package/LICENSE xterm.LICENSE \
	  && rm -rf package .npm xterm-xterm-$(XTERM_VERSION).tgz
	@touch $@

# Idempotent: each user is made once (no home, no login shell needed), the first gets a
# subordinate uid and gid range for newuidmap/newgidmap, the second none. Skipped (with a
# word) when make does not run as root: the rootless tests then skip too.
rootless-users:
	@if [ "$$(id -u)" != 0 ]; then echo "not root: test users $(ROOTLESS_USER)/$(NOSUBID_USER) not made"; exit 0; fi; \
	for u in $(ROOTLESS_USER) $(NOSUBID_USER); do \
	  getent passwd $$u >/dev/null || useradd --system --user-group --no-create-home --shell /bin/sh $$u; \
	done; \
	for f in /etc/subuid /etc/subgid; do \
	  touch $$f; \
	  grep -q '^$(ROOTLESS_USER):' $$f || echo '$(ROOTLESS_USER):$(ROOTLESS_SUBIDS)' >> $$f; \
	  sed -i '/^$(NOSUBID_USER):/d' $$f; \
	done

$(STAMP): pyproject.toml
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VPY) examples/demo.py

lint: setup
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

test: setup lint
	$(VPY) -m pytest -q

# The whole backend contract and attack suites on the microVM backend (make test runs a slice
# of them there: tests/test_microvm.py, tests/security/test_attack_microvm.py).
test-microvm: setup
	CORRAL_TEST_BACKENDS=microvm $(VPY) -m pytest -q -k microvm tests

# The attack suite and the backend contract whole, as each unprivileged test user, on bwrap,
# runc and crun rootless (make test runs a subset: every attack category, on bwrap).
test-rootless: setup
	CORRAL_ROOTLESS_FULL=1 $(VPY) -m pytest -q tests/test_rootless.py -k attack_and_contract

# The backend contract and attack suites on gVisor (runsc): the tests that take a box, with
# the oci-runsc parameter only.
test-runsc: setup
	CORRAL_TEST_BACKENDS=oci-runsc $(VPY) -m pytest -q -k runsc tests

# The attack suite with the issue's full stress counts (1000 boxes in a row, 100 at once),
# then its table: category, attacks tried, contained; latency of a second box under attack.
SECURITY_JSON := $(or $(TMPDIR),/tmp)/corral-security-report.json
security-report: setup
	@rm -f $(SECURITY_JSON)
	CORRAL_STRESS=1 CORRAL_SECURITY_REPORT=$(SECURITY_JSON) $(VPY) -m pytest -q tests/security; \
	status=$$?; $(VPY) tests/security/report.py $(SECURITY_JSON) $(REPORT_ARGS) || status=1; exit $$status

# The rootless columns of SECURITY.md's attack table: make test-rootless's run, with its
# reports (one per test user), rendered beside the root table.
security-report-rootless: setup
	@rm -f $(SECURITY_JSON).rootless.*
	CORRAL_ROOTLESS_FULL=1 CORRAL_ROOTLESS_REPORT=$(SECURITY_JSON).rootless $(VPY) -m pytest -q \
	  tests/test_rootless.py -k attack_and_contract; status=$$?; \
	$(VPY) tests/security/report.py --rootless $(SECURITY_JSON).rootless.$(ROOTLESS_USER).json \
	  $(SECURITY_JSON).rootless.$(NOSUBID_USER).json $(REPORT_ARGS) || status=1; exit $$status

bench: setup
	$(VPY) bench/run.py
	$(VPY) bench/bench_network.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
