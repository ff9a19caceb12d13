"""Run the rootless slice (tests/rootless/) as the unprivileged test users ``make setup``
makes: ``corral-rootless`` (subordinate ids) and ``corral-nosubid`` (none).

The checkout and its venv may lie where those users cannot go (CI clones under /root, mode
0700): the slice runs in a private mount namespace where the checkout is bound at a path they
can reach (a 0755 directory in /tmp), through the same venv, with the checkout's ``src``
first on ``sys.path``. Nothing is copied or made readable on the host; the bind goes with the
namespace."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.base import AGENT_DIR
from corral.backends.host.python import compile_agent, find_python
from corral.backends.users import BOX_UID

REPO = Path(__file__).resolve().parents[1]
USERS = ("corral-rootless", "corral-nosubid")


def _skip_reason(user: str) -> str | None:
    if os.geteuid() != 0:
        return "switching to a test user needs root (tests/rootless/ runs as you directly)"
    for tool in ("runuser", "unshare", "mount", "bwrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        pwd.getpwnam(user)
    except KeyError:
        return f"test user {user} does not exist: run `make setup` as root"
    return None


def _python_in(view: Path) -> str:
    """This interpreter as seen through the bound checkout (its venv, when inside it)."""
    exe = Path(sys.executable)
    try:
        return str(view / exe.relative_to(REPO))
    except ValueError:
        return str(exe)  # a venv elsewhere: it must be readable by the user as it is


def _cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"] and " ro," not in f" {left.split()[5]},":
            return Path(left.split()[4])
    return None


def _delegate(user: str) -> Path | None:
    """A cgroup v2 subtree given to ``user`` as systemd's ``Delegate=yes`` would: the group
    root and its ``cgroup.procs``/``cgroup.subtree_control``/``cgroup.threads`` chowned to
    the user, and a ``leaf`` group (the user's too) the test's processes start in."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    root = mount / f"corral-delegated-{os.getpid()}"
    (root / "leaf").mkdir(parents=True)
    uid = pwd.getpwnam(user).pw_uid
    for path in (
        root,
        root / "cgroup.procs",
        root / "cgroup.subtree_control",
        root / "cgroup.threads",
        root / "leaf",
        root / "leaf" / "cgroup.procs",
    ):
        os.chown(path, uid, -1)
    return root


def _undelegate(root: Path) -> None:
    for group in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if group.is_dir():
            group.rmdir()
    root.rmdir()


def _run_as(
    user: str,
    targets: list[str],
    *,
    env_extra: dict[str, str] | None = None,
    cgroup: Path | None = None,
    cwd: str = "/",
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """pytest on ``targets`` (paths relative to the checkout, ``-k`` and the like) as
    ``user``, through the checkout bound at a path the user can reach."""
    compile_agent(AGENT_DIR, find_python())  # the user cannot write the agent's .pyc
    holder = Path(tempfile.mkdtemp(prefix="corral-rootless-view-"))
    try:
        holder.chmod(0o755)
        view = holder / "repo"
        view.mkdir(mode=0o755)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("CORRAL_", "PYTEST_", "XDG_")) and k not in ("TMPDIR", "HOME")
        }
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(view / "src"), **(env_extra or {}))
        script = 'mount --bind "$1" "$2" && shift 2 && exec runuser -u "$@"'  # bind, then user
        if cgroup is not None:
            env["CORRAL_CGROUP_DELEGATE"] = str(cgroup)
            script = f"echo $$ > {cgroup}/leaf/cgroup.procs && {script}"  # start in the leaf
        args = [a if a.startswith("-") or "/" not in a else str(view / a) for a in targets]
        argv = [
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(REPO), str(view), user, "--", _python_in(view), "-m", "pytest", "-q",
            "-p", "no:cacheprovider", "--rootdir", str(view), *args,
        ]  # fmt: skip
        return subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    finally:
        shutil.rmtree(holder, ignore_errors=True)


DELEGATED = " or ".join(
    (
        "says_how", "says_rootless", "bounded", "pids", "delegated", "closing", "swept",
        "stop_kills", "corral_run", "users_server",
    )
)  # fmt: skip
"""The rootless tests whose path a delegated cgroup v2 subtree changes: where a box lands and
what it reports, its limits, how it is killed, closed and swept (a microVM takes none)."""


@pytest.mark.parametrize(
    ("user", "delegated"),
    [("corral-rootless", False), ("corral-nosubid", False), ("corral-rootless", True)],
)
def test_the_rootless_slice_passes_as_an_unprivileged_user(user: str, delegated: bool) -> None:
    why = _skip_reason(user)
    if why is not None:
        pytest.skip(why)
    cgroup = _delegate(user) if delegated else None
    if delegated and cgroup is None:
        pytest.skip("no writable cgroup v2 hierarchy here to delegate a subtree of")
    try:
        targets = ["--confcutdir", "tests/rootless", "tests/rootless"]
        if delegated:  # what a delegated cgroup changes; the rest ran in the slices before
            targets += ["-k", DELEGATED]
        elif user == "corral-nosubid":  # qemu takes no subordinate ids: one TCG boot is enough
            targets += ["-k", "not a_microvm_runs_rootless"]
        out = _run_as(user, targets, cgroup=cgroup)
    finally:
        if cgroup is not None:
            _undelegate(cgroup)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    summary = out.stdout.splitlines()[-1]
    # Nothing skipped but the delegated-cgroup test when no subtree was delegated.
    assert " passed" in summary and ("skipped" not in summary or summary.count(" 1 skipped")), tail
    assert not (delegated and "skipped" in summary), tail


# The attack suite and the backend contract as each test user (``CORRAL_TEST_ROOTLESS=1``:
# tests/conftest.py then gives the contract fixtures rootless boxes and keeps only the attack
# suite and the tests that take a backend). ``make test`` runs a subset on the default
# rootless backend (bwrap): every attack category at least once. ``make test-rootless``
# (``CORRAL_ROOTLESS_FULL=1``) runs both suites whole, on bwrap, runc and crun.
SUBSET = [
    *(
        f"tests/security/test_{name}.py"
        for name in (
            "attack_filesystem", "attack_host_paths", "attack_privilege", "attack_processes",
            "attack_terminal", "attack_network", "attack_protocol", "exhaustion", "faults",
        )
    ),
    "tests/test_sandbox.py",
    "-k",
    " or ".join(
        (
            "read_a_root_only_host_file", "mask_path_swapped", "read_the_agents_fds",
            "double_fork_daemon", "tiocsti_through_dev_tty",
            "host_unix_sockets_in_private_dirs", "oversize_and_zero_lengths", "fork_bomb",
            "sigkill_the_host_process", "info_reports_the_box",
        )
    ),
]  # fmt: skip
"""``make test``'s share: an attack or two of every category (filesystem, privilege,
processes, terminal, network, protocol, exhaustion, faults) and a contract test, on bwrap
(the whole run: ``make test-rootless``)."""
FULL = ["tests"]


@contextlib.contextmanager
def _root_made(user: str) -> Iterator[dict[str, str]]:
    """What the slice's user cannot make and its tests need, made here as root; the
    variables that tell the tests where (tests/security/conftest.py, tests/test_host_view.py):

    - a 0777 directory in /opt (the system view every box sees) for the canaries;
    - ``root-only`` (root's, 0600), ``user-only`` (host uid 1000's, 0600) and
      ``home/id_key`` (0644 in uid 1000's 0700 directory): other users' private files;
    - a directory with a readable file in each place host data lives (/srv, /mnt, ...);
    - a working directory the user may write (hypothesis keeps its database there)."""
    made: list[Path] = []
    try:
        canary = Path(tempfile.mkdtemp(prefix="corral-rootless-canary-", dir="/opt"))
        made.append(canary)
        canary.chmod(0o777)
        files = canary / "root-made"
        files.mkdir(mode=0o755)
        for name, owner in (("root-only", 0), ("user-only", BOX_UID)):
            (files / name).write_text(f"SECRET-{name}\n")
            (files / name).chmod(0o600)
            os.chown(files / name, owner, owner)
        (files / "home").mkdir(mode=0o700)
        (files / "home" / "id_key").write_text("SECRET-key\n")
        for path in (files / "home", files / "home" / "id_key"):
            os.chown(path, BOX_UID, BOX_UID)
        data = []
        for top in ("/srv", "/mnt", "/media", "/home", "/root", "/var/lib", "/"):
            if Path(top).is_dir():
                where = Path(tempfile.mkdtemp(prefix="corral-view-", dir=top))
                made.append(where)
                where.chmod(0o755)
                (where / "secret.txt").write_text("host data\n")
                (where / "secret.txt").chmod(0o644)
                data.append(str(where))
        cwd = Path(tempfile.mkdtemp(prefix="corral-rootless-cwd-"))
        made.append(cwd)
        uid = pwd.getpwnam(user).pw_uid
        os.chown(cwd, uid, -1)
        yield {
            "CORRAL_TEST_CANARY_PARENT": str(canary),
            "CORRAL_TEST_ROOT_FILES": str(files),
            "CORRAL_TEST_HOST_DATA": ":".join(data),
            "cwd": str(cwd),
        }
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("user", USERS)
def test_the_attack_and_contract_suites_hold_as_an_unprivileged_user(user: str) -> None:
    why = _skip_reason(user)
    if why is not None:
        pytest.skip(why)
    full = os.environ.get("CORRAL_ROOTLESS_FULL") == "1"
    with _root_made(user) as env:
        cwd = env.pop("cwd")
        env["CORRAL_TEST_ROOTLESS"] = "1"
        # The slice judges isolation; the event-loop watch judges the same library code in
        # the root run. Two users' boxes on top of the root run's load go over 20 ms at
        # random, so the watch here only catches real blocking.
        env["CORRAL_SLOW_CALLBACK_MS"] = "100"
        env["CORRAL_TEST_BACKENDS"] = "bwrap,oci-runc,oci-crun" if full else "bwrap"
        report = os.environ.get("CORRAL_ROOTLESS_REPORT")  # the SECURITY.md rootless columns
        if report:
            env["CORRAL_SECURITY_REPORT"] = f"{report}.{user}.json"
        targets = ["-rfEs", *(FULL if full else SUBSET)]
        out = _run_as(user, targets, env_extra=env, cwd=cwd, timeout=3000)
    tail = (out.stdout + out.stderr)[-8000:]
    assert out.returncode == 0, tail
    summary = out.stdout.splitlines()[-1]
    assert " passed" in summary and " failed" not in summary, tail
