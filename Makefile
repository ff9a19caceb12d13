# corral: `make demo` and `make test` work on a fresh Debian 12 machine as root.
SHELL := /bin/bash
PY := /usr/bin/python3
VENV := .venv
VPY := $(VENV)/bin/python
APT_PACKAGES := bubblewrap python3-venv gcc git iproute2 tmux runc crun passt slirp4netns curl nodejs
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

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

bench: setup
	$(VPY) bench/run.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache
