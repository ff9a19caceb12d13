"""The security suite's own plumbing: attack categories, a host guard, and the report.

* Every attack test carries ``@pytest.mark.attack("<category>")`` (a module-level
  ``pytestmark``); ``make security-report`` counts them per category.
* ``host_guard`` (autouse) snapshots host state an escape would change (canary files outside
  the workspace, kernel.core_pattern, the hostname) and checks after the test, once every
  sandbox of the test is closed, that it is unchanged and no process of those boxes is left.
* With ``CORRAL_SECURITY_REPORT=FILE`` the session writes a JSON report: one row per test
  (category, backend, outcome) plus the responsiveness figures the exhaustion tests record.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from security.helpers import host_pids_mentioning, read_host

CATEGORIES = ("filesystem", "privilege", "processes", "terminal", "network", "protocol")
_ROWS: list[dict[str, Any]] = []
_FIGURES: list[dict[str, Any]] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "attack(category): an escape attempt, counted per category in the report"
    )
    config.addinivalue_line("markers", "exhaustion: a resource attack (contained and reported)")
    config.addinivalue_line("markers", "fault: a fault or leak test")
    config.addinivalue_line("markers", "fuzz: a property test over hostile input")


def backend_label(policy: Policy) -> str:
    """``bwrap``, ``oci-runc``, ``oci-crun``: how the report names a box's backend."""
    return f"{policy.backend}-{policy.runtime}" if policy.runtime else policy.backend


def record_figure(**figure: Any) -> None:
    """Keep a measurement (e.g. latency of ``true`` in a second box) for the report."""
    _FIGURES.append(figure)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    if report.when == "call" or report.skipped or report.failed:
        row = {
            "nodeid": report.nodeid,
            "outcome": "xfailed" if hasattr(report, "wasxfail") else report.outcome,
            "duration": round(report.duration, 3),
            **dict(report.user_properties),
        }
        if report.skipped and isinstance(report.longrepr, tuple):
            row["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        _ROWS.append(row)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("attack")
    kind = "attack" if marker else None
    if marker is not None:
        category = str(marker.args[0])
        assert category in CATEGORIES, f"unknown attack category {category!r}"
    elif item.get_closest_marker("exhaustion"):
        kind, category = "exhaustion", "exhaustion"
    elif item.get_closest_marker("fault"):
        kind, category = "fault", "faults"
    else:
        kind, category = "other", item.path.stem
    backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend_name", "-")
    item.user_properties += [("kind", kind), ("category", category), ("backend", backend)]


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("CORRAL_SECURITY_REPORT")
    if not path or not _ROWS:
        return
    Path(path).write_text(json.dumps({"tests": _ROWS, "figures": _FIGURES}, indent=1))


@dataclass(frozen=True)
class Canary:
    """Host files outside the workspace that the box can see (read-only) and must not change."""

    dir: Path
    file: Path
    content: str

    def state(self) -> tuple[Any, ...]:
        entries = sorted(os.listdir(self.dir)) if self.dir.is_dir() else None
        st = self.file.stat() if self.file.exists() else None
        snapshot = (st.st_mode, st.st_mtime_ns, st.st_size, st.st_uid) if st else None
        return (entries, snapshot, read_host(str(self.file)))


def root_made_files() -> Path | None:
    """In the rootless slice, host files its user cannot make (tests/test_rootless.py makes
    them as root): ``root-only`` (root's, 0600), ``user-only`` (uid 1000's, 0600) and
    ``home/id_key`` (0644 in uid 1000's 0700 directory). None outside that slice."""
    made = os.environ.get("CORRAL_TEST_ROOT_FILES")
    return Path(made) if made else None


@pytest.fixture(scope="session")
def canary() -> Iterator[Canary]:
    # /opt is part of the host system every box sees read-only (/var/tmp is the box's /tmp).
    # A rootless run's user cannot write /opt: the runner (root) made a 0777 directory there.
    parent = Path(os.environ.get("CORRAL_TEST_CANARY_PARENT", "/opt"))
    base = parent / f"corral-canary-{secrets.token_hex(4)}"
    base.mkdir(mode=0o755)
    content = f"canary {secrets.token_hex(8)}\n"
    file = base / "canary.txt"
    file.write_text(content)
    file.chmod(0o666)  # even world-writable: only the read-only mount protects it
    base.chmod(0o777)
    yield Canary(base, file, content)
    shutil.rmtree(base, ignore_errors=True)


def _host_state(canary: Canary) -> dict[str, Any]:
    return {
        "canary": canary.state(),
        "core_pattern": read_host("/proc/sys/kernel/core_pattern"),
        "hostname": socket.gethostname(),
        "modprobe": read_host("/proc/sys/kernel/modprobe"),
    }


@pytest.fixture(autouse=True)
def host_guard(request: pytest.FixtureRequest, canary: Canary) -> Iterator[None]:
    before = _host_state(canary)
    yield
    after = _host_state(canary)
    assert after == before, f"the host changed: {before} -> {after}"
    assert canary.file.read_text() == canary.content
    for value in request.node.funcargs.values():
        if isinstance(value, Sandbox) and value.closed:
            assert host_pids_mentioning(value.sandbox_id) == [], "a box process outlived close"
