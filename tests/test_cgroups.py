"""Tests of corral.backends.host.cgroups.

The first half runs against the real kernel (this is what the module is for: a memory
bomb must really be OOM-killed, a fork bomb must really hit pids.max). Those tests skip,
with the reason, where cgroups are not usable. The v2 code paths are also exercised against
a fake cgroup2 tree in tmp_path, because a hybrid v1 host has no v2 controllers to test on;
the fake only stands in for the kernel's creation of interface files.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import corral.backends.host.cgroups as cgmod
from corral.backends.host.cgroups import (
    MIN_MEMORY_BYTES,
    Cgroup,
    CgroupLimits,
    CgroupSupport,
    detect,
    sweep_orphans,
)
from corral.errors import BackendError, BackendUnavailable

PYTHON = "/usr/bin/python3"
MiB = 1024 * 1024
# Generous bound for any single wait on a child; a healthy run takes well under a second.
WAIT_S = 10.0

SUPPORT = detect()


def _needs(*controllers: str) -> pytest.MarkDecorator:
    missing = [c for c in controllers if c not in SUPPORT.controllers]
    return pytest.mark.skipif(
        not SUPPORT.usable or bool(missing),
        reason=f"needs writable cgroup controllers {missing or list(controllers)}: "
        f"{SUPPORT.reason}",
    )


def _unique(tag: str) -> str:
    return f"test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


MakeGroup = Callable[[CgroupLimits], Cgroup]


@pytest.fixture
def make_group() -> Iterator[MakeGroup]:
    """Create real groups with unique names; remove them (and their processes) after."""
    made: list[Cgroup] = []

    def make(limits: CgroupLimits) -> Cgroup:
        group = Cgroup.create(_unique("g"), limits, SUPPORT)
        made.append(group)
        return group

    yield make
    for group in made:
        group.remove()


def _gated(code: str, **kwargs: object) -> subprocess.Popen[bytes]:
    """A python child that runs ``code`` only after a line arrives on stdin.

    The gate lets the test move the child into the group before it does anything.
    """
    script = "import sys\nsys.stdin.readline()\n" + code
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [PYTHON, "-c", script], stdin=subprocess.PIPE, **kwargs
    )


def _release(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.close()


def _cpu_dir(group: Cgroup) -> Path:
    return group.paths.get("cpu") or group.paths[""]


# --------------------------------------------------------------------------- real kernel


@_needs("memory")
def test_memory_bomb_is_oom_killed_inside_the_group(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits(memory_bytes=64 * MiB))
    assert group.oom_kills() == 0  # read once before: the counter's descriptor stays open
    # bytes * n fills every page, so the whole 200 MB is really charged.
    with _gated("b = b'x' * (200 << 20)\nprint(len(b))") as proc:
        group.add(proc.pid)
        assert group.pids() == [proc.pid]
        _release(proc)
        assert proc.wait(timeout=WAIT_S) == -9  # SIGKILL from the OOM killer
    stats = group.stats()
    assert stats.oom_kills >= 1
    assert group.oom_kills() == stats.oom_kills  # the kept descriptor reads the file anew
    assert stats.memory_peak is not None
    # The cap held: the peak never went past 64 MiB (the kernel counts in pages).
    assert 32 * MiB < stats.memory_peak <= 64 * MiB
    assert group.pids() == []


@_needs("pids")
def test_counter_descriptors_are_closed_when_the_group_is_removed() -> None:
    group = Cgroup.create(_unique("g"), CgroupLimits(max_pids=20), SUPPORT)
    try:
        before = set(os.listdir("/proc/self/fd"))
        assert group.pids_limit_hits() == 0 and group.oom_kills() == 0
        assert len(set(os.listdir("/proc/self/fd")) - before) >= 1
    finally:
        group.remove()
    assert not set(os.listdir("/proc/self/fd")) - before
    assert group.pids_limit_hits() == 0  # gone: nothing to count, no error


@_needs("pids")
def test_fork_bomb_hits_pids_max_and_host_is_fine(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits(max_pids=20))
    assert group.pids_limit_hits() == 0
    bomb = (
        "import os, signal\n"
        "n = 0\n"
        "err = 0\n"
        "try:\n"
        "    while n < 500:\n"
        "        if os.fork() == 0:\n"
        "            os.close(1)  # let the parent's reader see EOF when it exits\n"
        "            signal.pause()\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    err = e.errno\n"
        "print(n, err, flush=True)\n"
        "sys.stdin.readline()  # stay until killed\n"
    )
    with _gated(bomb, stdout=subprocess.PIPE) as proc:
        group.add(proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")  # stdin stays open: the bomb waits on it after forking
        proc.stdin.flush()
        assert proc.stdout is not None
        forks, err = map(int, proc.stdout.readline().split())
        assert err == errno.EAGAIN  # fork failed: pids.max reached
        # At most 20 tasks: the bomb itself plus 19 children (fewer if python had threads).
        assert 1 <= forks <= 19
        stats = group.stats()
        assert stats.pids_limit_hits >= 1
        assert group.pids_limit_hits() == stats.pids_limit_hits
        assert stats.pids_current == 20
        group.kill_all()
        assert group.pids() == []
        assert proc.wait(timeout=WAIT_S) == -9
    # The host is unaffected: it can still start processes.
    assert subprocess.run(["/bin/true"], check=False, timeout=WAIT_S).returncode == 0


@_needs("cpu", "cpuacct")
def test_cpu_quota_throttles(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits(cpu_quota=0.2))
    assert (_cpu_dir(group) / "cpu.cfs_quota_us").read_text().strip() == "20000"
    # Burn 0.15 s of CPU: at 20 ms per 100 ms period that needs ~7 periods, throttled 6x.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.15:\n    pass\n"
    with _gated(burn) as proc:
        group.add(proc.pid)
        _release(proc)
        assert proc.wait(timeout=WAIT_S) == 0
    throttled = cgmod._read_key(_cpu_dir(group) / "cpu.stat", "nr_throttled")
    assert throttled is not None
    assert throttled > 0
    usage = group.stats().cpu_usage_ns
    assert usage is not None
    assert usage >= 150_000_000


@_needs("pids", "freezer")
def test_kill_all_kills_process_tree(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits(max_pids=50))
    tree = (
        "import os, signal\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        signal.pause()\n"
        "        os._exit(0)\n"
        "print('ready', flush=True)\n"
        "signal.pause()\n"
    )
    with _gated(tree, stdout=subprocess.PIPE) as proc:
        group.add(proc.pid)
        _release(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert len(group.pids()) == 4
        group.kill_all()
        assert group.pids() == []
        assert proc.wait(timeout=WAIT_S) == -9
    group.kill_all()  # on an empty group: a no-op


@_needs("memory", "pids")
def test_remove_kills_and_deletes_every_directory() -> None:
    group = Cgroup.create(_unique("rm"), CgroupLimits(memory_bytes=64 * MiB, max_pids=10), SUPPORT)
    try:
        assert all(p.is_dir() for p in group.paths.values())
        with _gated("") as proc:
            group.add(proc.pid)
            group.remove()
            assert proc.wait(timeout=WAIT_S) == -9
        assert not any(p.exists() for p in group.paths.values())
        group.remove()  # idempotent
        assert group.pids() == []
    finally:
        group.remove()


@_needs("memory")
def test_sweep_orphans_removes_only_dead_owners(make_group: MakeGroup) -> None:
    live = make_group(CgroupLimits(memory_bytes=64 * MiB))
    orphan_name = _unique("orphan")
    orphan = Cgroup.create(orphan_name, CgroupLimits(memory_bytes=64 * MiB), SUPPORT)
    paths = list(orphan.paths.values())
    try:
        with _gated("") as proc:
            orphan.add(proc.pid)
            del orphan  # as if the host crashed: nothing remembers the group
            # Only our orphan is "dead"; groups of concurrent runs must survive.
            removed = sweep_orphans(lambda name: name != orphan_name, SUPPORT)
            assert proc.wait(timeout=WAIT_S) == -9
        assert removed == [orphan_name]
        assert not any(p.exists() for p in paths)
        assert live.path.is_dir()
    finally:
        Cgroup(orphan_name, "v1", {}, CgroupLimits(), SUPPORT).remove()
        for p in paths:
            if p.exists():
                p.rmdir()


@_needs("memory")
def test_create_refuses_duplicate_name(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits(memory_bytes=64 * MiB))
    with pytest.raises(BackendError, match="already exists"):
        Cgroup.create(group.name, CgroupLimits(), SUPPORT)
    assert group.path.is_dir()  # the failed attempt did not tear down the original


@_needs("memory")
def test_add_missing_pid_is_backend_error(make_group: MakeGroup) -> None:
    group = make_group(CgroupLimits())
    with subprocess.Popen([PYTHON, "-c", "pass"]) as proc:
        proc.wait(timeout=WAIT_S)
    with pytest.raises(BackendError, match="no such process"):
        group.add(proc.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_detect_as_unprivileged_user_reports_unusable() -> None:
    # A real unprivileged process, not a mock: it must see cgroups as unusable and say why.
    code = (
        "from corral.backends.host.cgroups import detect, Cgroup, CgroupLimits\n"
        "from corral.errors import BackendUnavailable\n"
        "s = detect()\n"
        "print(s.version)\n"
        "try:\n"
        "    Cgroup.create('x', CgroupLimits(), s)\n"
        "except BackendUnavailable as e:\n"
        "    print(e.code, e.message)\n"
    )
    src = str(Path(cgmod.__file__).parents[4])
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            user=65534,
            group=65534,
            extra_groups=[],
            env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=True,
        ).stdout
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot run python as nobody here: {e.stderr.strip()[-200:]}")
    version, rest = out.split("\n", 1)
    assert version == "none"
    assert rest.startswith("backend_unavailable cgroups are not usable")
    assert "no write permission" in rest
    assert "run corral as root" in rest


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"memory_bytes": MIN_MEMORY_BYTES - 1}, "too small"),
        ({"memory_bytes": 0}, "too small"),
        ({"memory_bytes": 1.5e9}, "integer"),
        ({"memory_bytes": True}, "integer"),
        ({"cpu_quota": 0.0}, "too small"),
        ({"cpu_quota": -1.0}, "too small"),
        ({"cpu_quota": float("nan")}, "finite"),
        ({"cpu_quota": float("inf")}, "finite"),
        ({"max_pids": 0}, "at least 1"),
        ({"max_pids": "10"}, "integer"),
    ],
)
def test_bad_limits_are_backend_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(BackendError, match=match):
        CgroupLimits(**kwargs)  # type: ignore[arg-type]


def test_good_limits() -> None:
    limits = CgroupLimits(memory_bytes=MIN_MEMORY_BYTES, cpu_quota=0.01, max_pids=1)
    assert limits.wanted() == {"memory_bytes", "cpu_quota", "max_pids"}
    assert CgroupLimits().wanted() == frozenset()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "-x", ".hidden", "a b", "x" * 101])
def test_bad_names_rejected(name: str, tmp_path: Path) -> None:
    support = CgroupSupport("v2", frozenset({"memory"}), str(tmp_path), "fake")
    with pytest.raises(BackendError, match="invalid cgroup name"):
        Cgroup.create(name, CgroupLimits(), support)


# --------------------------------------------------------------------------- detect()


def _mountinfo(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_detect_hybrid_v1(tmp_path: Path) -> None:
    for d in ("memory", "pids", "cpu,cpuacct", "unified"):
        (tmp_path / d).mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("\n")  # v2 with nothing in it
    info = _mountinfo(
        tmp_path,
        f"31 23 0:28 / {tmp_path} rw,relatime - tmpfs tmpfs rw,mode=755",
        f"32 31 0:29 / {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory",
        f"33 31 0:30 / {tmp_path}/pids rw,relatime shared:5 - cgroup cgroup rw,pids",
        f"34 31 0:31 / {tmp_path}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct",
        f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw",
    )
    s = detect(info)
    assert s.version == "v1"
    assert s.controllers == {"memory", "pids", "cpu", "cpuacct"}
    assert s.root == str(tmp_path)
    assert s.mounts["cpu"] == s.mounts["cpuacct"] == f"{tmp_path}/cpu,cpuacct"
    assert "missing or unusable: freezer" in s.reason


def test_detect_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma\n")
    info = _mountinfo(
        tmp_path,
        f"30 23 0:26 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot",
    )
    s = detect(info)
    assert s.version == "v2"
    assert s.controllers == {"memory", "pids", "cpu"}
    assert s.root == str(tmp_path)


def test_detect_v2_path_with_space(tmp_path: Path) -> None:
    root = tmp_path / "cg root"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    escaped = str(root).replace(" ", "\\040")
    s = detect(_mountinfo(tmp_path, f"30 23 0:26 / {escaped} rw - cgroup2 cgroup2 rw"))
    assert s.version == "v2"
    assert s.root == str(root)
    assert s.controllers == {"memory", "pids"}


def test_detect_read_only_v2_is_unusable_with_fix(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids cpu\n")
    s = detect(_mountinfo(tmp_path, f"30 23 0:26 / {tmp_path} ro,nosuid - cgroup2 cgroup2 rw"))
    assert s.version == "none"
    assert "read-only" in s.reason
    assert "run corral as root" in s.reason
    with pytest.raises(BackendUnavailable, match="read-only"):
        Cgroup.create("x", CgroupLimits(), s)


def test_detect_nothing_mounted(tmp_path: Path) -> None:
    s = detect(_mountinfo(tmp_path, "22 1 0:21 / /proc rw - proc proc rw"))
    assert s.version == "none"
    assert "no cgroup filesystem" in s.reason
    assert detect(str(tmp_path / "missing")).version == "none"


def test_detect_this_host_matches_mountinfo() -> None:
    # Whatever this host is, detect() must agree with what is actually mounted.
    text = Path("/proc/self/mountinfo").read_text()
    s = detect()
    if s.version == "v1":
        assert " - cgroup " in text
        assert all(Path(p).is_dir() for p in s.mounts.values())
    elif s.version == "v2":
        assert (Path(s.root) / "cgroup.controllers").is_file()


# --------------------------------------------------------------------------- fake v2 tree

_V2_FILES = {
    "memory": ("memory.max", "memory.swap.max", "memory.current", "memory.peak", "memory.events"),
    "pids": ("pids.max", "pids.current", "pids.events"),
    "cpu": ("cpu.max",),
}


class FakeKernel:
    """Stands in for cgroupfs on a plain directory: creates interface files on mkdir and
    records every write the module makes, in order."""

    def __init__(self, root: Path, controllers: str) -> None:
        self.root = root
        self.writes: list[tuple[str, str]] = []
        root.mkdir(exist_ok=True)
        (root / "cgroup.controllers").write_text(controllers + "\n")
        self._populate(root, root_group=True)

    def _populate(self, d: Path, *, root_group: bool = False) -> None:
        for f in ("cgroup.procs", "cgroup.subtree_control", "cgroup.events", "cpu.stat"):
            (d / f).touch()
        if root_group:
            return
        for f in ("cgroup.kill", "cgroup.freeze"):
            (d / f).touch()
        # A child gets the files of the controllers its parent enabled for it.
        enabled = self.enabled(d.parent)
        (d / "cgroup.controllers").write_text(" ".join(sorted(enabled)) + "\n")
        for c in enabled:
            for f in _V2_FILES.get(c, ()):
                (d / f).touch()

    def enabled(self, d: Path) -> set[str]:
        return set((d / "cgroup.subtree_control").read_text().split())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_write = cgmod._write

        def write(path: Path, value: str) -> None:
            self.writes.append((str(path.relative_to(self.root)), value))
            if path.name == "cgroup.subtree_control":
                # Like the kernel: "+c" adds c to the space-separated enabled set.
                assert value.startswith("+"), value
                enabled = self.enabled(path.parent) | {value[1:]}
                path.write_text(" ".join(sorted(enabled)) + "\n")
            else:
                real_write(path, value)

        def mkdir(d: Path) -> None:
            os.mkdir(d)
            self._populate(d)

        monkeypatch.setattr(cgmod, "_write", write)
        monkeypatch.setattr(cgmod, "_mkdir", mkdir)

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text()


@pytest.fixture
def fake_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    kernel = FakeKernel(tmp_path / "cgroup", "cpuset cpu io memory pids")
    kernel.install(monkeypatch)
    return kernel


def _v2_support(kernel: FakeKernel, controllers: frozenset[str]) -> CgroupSupport:
    return CgroupSupport("v2", controllers, str(kernel.root), "fake v2 tree")


ALL_V2 = frozenset({"memory", "pids", "cpu"})


def test_v2_create_writes_limits(fake_v2: FakeKernel) -> None:
    limits = CgroupLimits(memory_bytes=64 * MiB, cpu_quota=0.5, max_pids=20)
    group = Cgroup.create("box1", limits, _v2_support(fake_v2, ALL_V2))
    assert group.version == "v2"
    assert group.path == fake_v2.root / "corral" / "box1"
    assert group.paths == {"": group.path}
    assert group.unenforced == frozenset()
    assert fake_v2.writes == [
        # Controllers are delegated root -> corral/ -> corral/box1, one write each.
        ("cgroup.subtree_control", "+memory"),
        ("cgroup.subtree_control", "+pids"),
        ("cgroup.subtree_control", "+cpu"),
        ("corral/cgroup.subtree_control", "+memory"),
        ("corral/cgroup.subtree_control", "+pids"),
        ("corral/cgroup.subtree_control", "+cpu"),
        ("corral/box1/memory.max", str(64 * MiB)),
        ("corral/box1/memory.swap.max", "0"),
        ("corral/box1/pids.max", "20"),
        ("corral/box1/cpu.max", "50000 100000"),
    ]
    assert fake_v2.read("corral/box1/memory.max") == str(64 * MiB)
    assert fake_v2.read("corral/box1/memory.swap.max") == "0"
    assert fake_v2.read("corral/box1/cpu.max") == "50000 100000"
    assert "box1" in repr(group)
    assert "v2" in repr(group)


def test_v2_second_group_reuses_parent(fake_v2: FakeKernel) -> None:
    support = _v2_support(fake_v2, ALL_V2)
    Cgroup.create("a", CgroupLimits(max_pids=5), support)
    fake_v2.writes.clear()
    Cgroup.create("b", CgroupLimits(max_pids=7), support)
    assert fake_v2.writes == [("corral/b/pids.max", "7")]


def test_v2_missing_controller_is_reported_not_fatal(fake_v2: FakeKernel) -> None:
    limits = CgroupLimits(memory_bytes=64 * MiB, cpu_quota=1.0, max_pids=20)
    group = Cgroup.create("nocpu", limits, _v2_support(fake_v2, frozenset({"memory", "pids"})))
    assert group.unenforced == {"cpu_quota"}
    assert not any(path.endswith("cpu.max") for path, _ in fake_v2.writes)
    assert fake_v2.read("corral/nocpu/pids.max") == "20"
    assert "unenforced=['cpu_quota']" in repr(group)


def test_v2_no_swap_file_flags_swap_only_if_swap_active(
    fake_v2: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_populate = fake_v2._populate

    def populate_without_swap(d: Path, *, root_group: bool = False) -> None:
        real_populate(d, root_group=root_group)
        (d / "memory.swap.max").unlink(missing_ok=True)

    monkeypatch.setattr(fake_v2, "_populate", populate_without_swap)
    monkeypatch.setattr(cgmod, "_swap_active", lambda: True)
    group = Cgroup.create("s1", CgroupLimits(memory_bytes=64 * MiB), _v2_support(fake_v2, ALL_V2))
    assert group.unenforced == {"swap"}
    monkeypatch.setattr(cgmod, "_swap_active", lambda: False)
    group = Cgroup.create("s2", CgroupLimits(memory_bytes=64 * MiB), _v2_support(fake_v2, ALL_V2))
    assert group.unenforced == frozenset()


def test_v2_stats_kill_and_remove(fake_v2: FakeKernel) -> None:
    group = Cgroup.create("st", CgroupLimits(memory_bytes=8 * MiB), _v2_support(fake_v2, ALL_V2))
    d = group.path
    (d / "memory.current").write_text("1048576\n")
    (d / "memory.peak").write_text("8388608\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\n")
    (d / "pids.current").write_text("3\n")
    (d / "pids.events").write_text("max 4\n")
    (d / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
    assert group.stats() == cgmod.CgroupStats(
        memory_current=MiB,
        memory_peak=8 * MiB,
        oom_kills=2,
        pids_current=3,
        pids_limit_hits=4,
        cpu_usage_ns=1_500_000,
    )
    assert group.pids() == []
    group.kill_all()
    assert ("corral/st/cgroup.kill", "1") in fake_v2.writes
    # A plain directory full of files cannot be rmdir'ed like cgroupfs; empty it first.
    for f in d.iterdir():
        f.unlink()
    group.remove()
    assert not d.exists()
    group.remove()


def test_v2_sweep_orphans(fake_v2: FakeKernel) -> None:
    support = _v2_support(fake_v2, ALL_V2)
    for name in ("dead1", "alive", "dead2"):
        group = Cgroup.create(name, CgroupLimits(), support)
        for f in group.path.iterdir():
            f.unlink()
    removed = sweep_orphans(lambda name: name == "alive", support)
    assert removed == ["dead1", "dead2"]
    assert sorted(p.name for p in (fake_v2.root / "corral").iterdir() if p.is_dir()) == ["alive"]


def test_v1_missing_controllers_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A v1 host with only the pids hierarchy: memory and cpu limits cannot be enforced.
    pids_mount = tmp_path / "pids"
    pids_mount.mkdir()

    def mkdir(d: Path) -> None:
        os.mkdir(d)
        for f in ("cgroup.procs", "pids.max", "pids.current", "pids.events"):
            (d / f).touch()

    monkeypatch.setattr(cgmod, "_mkdir", mkdir)
    support = CgroupSupport(
        "v1", frozenset({"pids"}), str(tmp_path), "fake", mounts={"pids": str(pids_mount)}
    )
    limits = CgroupLimits(memory_bytes=64 * MiB, cpu_quota=0.5, max_pids=20)
    group = Cgroup.create("p", limits, support)
    assert group.unenforced == {"memory_bytes", "cpu_quota"}
    assert (pids_mount / "corral" / "p" / "pids.max").read_text() == "20"
    stats = group.stats()
    assert stats.memory_current is None
    assert stats.cpu_usage_ns is None
    assert stats.oom_kills == 0


def test_create_with_unusable_support_raises_unavailable() -> None:
    s = CgroupSupport("none", frozenset(), "", "cgroup v1: no write permission; run as root")
    with pytest.raises(BackendUnavailable, match="no write permission") as info:
        Cgroup.create("x", CgroupLimits(), s)
    assert info.value.code == "backend_unavailable"


def test_v1_groups_are_made_with_their_parent_the_first_time(tmp_path: Path) -> None:
    """The group is made first and ``corral/`` only when missing: a fresh hierarchy gets
    both, a second group just its own directory, a taken name a BackendError."""
    mounts = {c: str(tmp_path / c) for c in ("memory", "pids", "freezer")}
    for path in mounts.values():
        Path(path).mkdir()
    support = CgroupSupport("v1", frozenset(mounts), str(tmp_path), "fake", mounts)
    first = Cgroup.create("cb-first", CgroupLimits(), support)
    second = Cgroup.create("cb-second", CgroupLimits(), support)
    for path in mounts.values():
        assert sorted(p.name for p in Path(path, "corral").iterdir()) == ["cb-first", "cb-second"]
    assert set(first.paths) == set(second.paths) == set(mounts)
    with pytest.raises(BackendError, match="already exists"):
        Cgroup.create("cb-first", CgroupLimits(), support)
