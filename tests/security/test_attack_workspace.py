"""What one box leaves in a workspace for the next run (issue 13, round two): a policy file
it rewrote, setuid files that were already there, and mount sources swapped for symlinks
while a box starts.

* A policy file inside an area the box can write is refused (``loaded_from``), unless the
  caller takes it knowingly (``trust_writable``, ``--trust-writable-policy``).
* Writable areas are mounted nosuid (and the box's user namespace does not map host root),
  so a setuid-root file in the workspace grants nothing; corral never executes it.
* bwrap mounts sources in writable areas from a descriptor the host opened beneath the area
  (``--bind-fd``); the OCI runtimes mount by path, and the host checks the mounted object
  against the one it opened before the agent runs anything.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, PolicyError, Sandbox, SandboxError
from corral.backends.bwrap import args as bwrap_args
from corral.backends.host import safepath
from corral.backends.host.state import state_root
from security.conftest import Canary
from security.helpers import box_py, gvisor

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

WIDER = '[[filesystem.mounts]]\nhost = "/etc"\nguest = "/host-etc"\nmode = "rw"\n'


def _policy_file(path: Path, box_policy: Policy, extra: str = "") -> Path:
    """A policy file for ``box_policy``'s backend (the first box's, and the next run's)."""
    lines = [f'backend = "{box_policy.backend}"']
    if box_policy.runtime:
        lines.append(f'runtime = "{box_policy.runtime}"')
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


# ---- a policy file the box can write -------------------------------------------------------


async def test_a_policy_file_the_box_rewrote_is_not_loaded(
    box_policy: Policy, workspace: Path
) -> None:
    """Box one (its caller trusted the file) appends a mount of the host root to
    ``<workspace>/corral.toml``; the next run on that workspace, told to load that file,
    refuses to start at all."""
    path = _policy_file(workspace / "corral.toml", box_policy)
    async with Sandbox(Policy.load(path, trust_writable=True), workspace=workspace) as sb:
        r = await sb.run(["sh", "-c", f"printf '{WIDER}' >> /workspace/corral.toml"])
        assert r.exit_code == 0, r
    assert 'host = "/etc"' in path.read_text()
    for policy in (path, Policy.load(path)):  # as a path, or loaded first
        with pytest.raises(PolicyError, match=r"policy file .* which the box can write"):
            async with Sandbox(policy, workspace=workspace):
                pass


async def test_a_policy_file_reached_through_a_link_is_refused_too(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    inside = _policy_file(workspace / "p.toml", box_policy)
    outside_link = tmp_path / "corral.toml"
    outside_link.symlink_to(inside)  # the host's own link into the workspace
    with pytest.raises(PolicyError, match="which the box can write"):
        async with Sandbox(outside_link, workspace=workspace):
            pass
    shared = tmp_path / "shared"
    shared.mkdir()
    in_allow_write = _policy_file(
        shared / "p.toml", box_policy, f'[filesystem]\nallow_write = ["{shared}"]\n'
    )
    with pytest.raises(PolicyError, match="which the box can write"):
        async with Sandbox(in_allow_write, workspace=workspace):
            pass


async def test_a_policy_file_outside_or_trusted_is_taken(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    outside = _policy_file(tmp_path / "corral.toml", box_policy)
    async with Sandbox(outside, workspace=workspace) as sb:
        assert (await sb.run("echo ok")).stdout == "ok\n"
    inside = _policy_file(workspace / "corral.toml", box_policy)
    async with Sandbox(Policy.load(inside, trust_writable=True), workspace=workspace) as sb:
        assert (await sb.run("echo ok")).stdout == "ok\n"


def test_the_cli_refuses_a_policy_file_in_the_workspace(workspace: Path) -> None:
    (workspace / "corral.toml").write_text("[limits]\nmax_pids = 64\n")
    argv = [sys.executable, "-m", "corral", "run", "--policy", "corral.toml", "--", "true"]
    r = subprocess.run(argv, cwd=workspace, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "which the box can write" in r.stderr, r
    r = subprocess.run(
        [*argv[:4], "--trust-writable-policy", *argv[4:]],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r


# ---- setuid files already in the workspace -------------------------------------------------

SET_ID_RUN = r"""
import subprocess
res = {}
for name in ('suid-id', 'sgid-id'):
    out = subprocess.run(['/workspace/' + name, '-u'], capture_output=True, text=True)
    grp = subprocess.run(['/workspace/' + name, '-g'], capture_output=True, text=True)
    res[name] = [out.stdout.strip(), grp.stdout.strip()]
res['mount'] = [l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] == '/workspace']
"""


async def test_a_setuid_root_file_in_the_workspace_gives_no_privilege(
    sandbox: Sandbox, workspace: Path
) -> None:
    """Made by the host (an older corral, another tool, a restored backup): root-owned
    copies of ``id`` with the setuid and setgid bits. Run in the next box, they run as the
    box user; the workspace mount is nosuid. Rootless, only host root could plant a root-owned
    file: the user's own setuid copies are planted, and must run as the box's command user
    (with one id that is box root, which commands are anyway)."""
    rootless = os.geteuid() != 0
    for name, bits in (("suid-id", stat.S_ISUID), ("sgid-id", stat.S_ISGID)):
        target = workspace / name
        shutil.copy(shutil.which("id") or "/usr/bin/id", target)
        if not rootless:
            os.chown(target, 0, 0)
        target.chmod(0o755 | bits)
        assert target.stat().st_mode & bits  # planted as asked
    res = await box_py(sandbox, SET_ID_RUN)
    me = (await sandbox.run("id -u; id -g")).stdout.split() if rootless else ["1000", "1000"]
    assert res["suid-id"] == me, res
    assert res["sgid-id"] == me, res
    if not gvisor(sandbox):  # gVisor's mountinfo is its own; the bits are still ignored
        nosuid = res["mount"] and all("nosuid" in opts for opts in res["mount"])
        if rootless and sandbox.policy.runtime == "crun" and not nosuid:
            pytest.xfail(
                "crun 1.8 rootless mounts the read-write workspace without nosuid,nodev (it "
                "ignores the options on that bind; runc and bwrap apply them): the bits stay "
                "inert (no_new_privs, the ids above), and no device node can be made there"
            )
        assert nosuid, res


def test_host_code_never_executes_programs_in_the_workspace(workspace: Path) -> None:
    """``corral run`` in a project directory: executables in it named like the programs
    corral starts (bwrap, setpriv, unshare, python3, sh, ...) are never run by the host."""
    marker = workspace.parent / "ran-from-workspace"
    names = ("bwrap", "setpriv", "unshare", "cat", "python3", "sh", "crun", "runc", "nsenter")
    for name in names:
        fake = workspace / name
        fake.write_text(f"#!/bin/sh\necho {name} >> {marker}\n")
        fake.chmod(0o4755)
    env = {**os.environ, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    argv = [sys.executable, "-m", "corral", "run", "--", "true"]
    r = subprocess.run(argv, cwd=workspace, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r
    assert not marker.exists(), marker.read_text()


# ---- mount sources swapped between the host's check and the mount --------------------------


def test_bwrap_mounts_the_object_the_host_opened_not_the_path(
    workspace: Path, canary: Canary
) -> None:
    """The host opens ``<workspace>/shared`` beneath the workspace; a box running on the
    same workspace then swaps it for a link to a host directory. bwrap, given the
    descriptor, mounts what the host opened (or dies on the race), never the link's target."""
    source = workspace / "shared"
    source.mkdir()
    (source / "mine").write_text("the workspace's\n")
    fd = safepath.open_path(str(source), os.O_PATH, [str(workspace)])
    try:
        source.rename(workspace / "moved")
        source.symlink_to(canary.dir)  # the swap
        argv = ["bwrap", "--unshare-user", "--unshare-pid", "--ro-bind", "/", "/"]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/mnt"]
        argv += ["--ro-bind", str(source), "/mnt/data", "--", "ls", "/mnt/data"]
        argv = bwrap_args.binds_by_fd(argv, {str(source): fd})
        assert "--ro-bind-fd" in argv and str(source) not in argv
        r = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=30)
    finally:
        os.close(fd)
    assert canary.file.name not in r.stdout
    assert r.stdout == "mine\n" or r.returncode != 0, r


def test_a_link_already_in_place_is_never_opened(workspace: Path, canary: Canary) -> None:
    (workspace / "shared").symlink_to(canary.dir)
    with pytest.raises(OSError, match=r"link|loop"):
        safepath.open_path(str(workspace / "shared"), os.O_PATH, [str(workspace)])


async def test_an_oci_box_whose_mount_is_not_the_opened_object_is_refused(
    box_policy: Policy, workspace: Path
) -> None:
    """The OCI runtimes mount by path: the host compares the box's mount with the object it
    opened (``_check_pins``) before the agent runs anything. Checked here against a running
    box: its own ``.git`` passes, another directory's identity is refused."""
    if box_policy.backend != "oci" or box_policy.runtime == "runsc":
        pytest.skip("the check of runc's and crun's mounts")
    from corral.backends.oci.box import _check_pins

    (workspace / ".git").mkdir()
    (workspace / "other").mkdir()
    policy = Policy.from_dict(
        {**box_policy.model_dump(exclude_unset=True), "filesystem": {"deny_write": [".git"]}}
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        pid = sb._box.init_pid  # type: ignore[union-attr]
        assert pid is not None
        git, other = (workspace / ".git").stat(), (workspace / "other").stat()
        _check_pins(pid, [("/workspace/.git", git.st_dev, git.st_ino)])
        with pytest.raises(PolicyError, match="changed while the box started"):
            _check_pins(pid, [("/workspace/.git", other.st_dev, other.st_ino)])


async def test_a_source_swapped_after_the_hosts_open_never_reaches_an_oci_box(
    box_policy: Policy, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``deny_write: [.git]`` binds ``<workspace>/.git`` read-only at ``/workspace/.git``;
    a box running on the same workspace swaps it for a link to a host directory the box
    never sees (under /srv) once the host has opened it and before the runtime mounts it
    (made certain here: the swap runs just before the runtime). runc and crun mount by path:
    the start is refused (the mount is not the object the host opened). runsc's gofer opens
    sources by path and the host cannot look into it: it is given a staging mount point
    bound from the host's fd, so the host directory never reaches the box."""
    if box_policy.backend != "oci":
        pytest.skip("bwrap mounts from the host's fd: test_bwrap_mounts_the_object_the_host...")
    from corral.backends.oci import box as oci_box

    # Rootless, the user cannot write /home: its own /tmp is as far from the box's view.
    hidden = (
        Path("/home") if os.geteuid() == 0 else workspace.parent
    ) / f"corral-hidden-{os.getpid()}"
    hidden.mkdir(parents=True)
    (hidden / "host-only").write_text("host data\n")
    hidden.chmod(0o755)
    (workspace / ".git").mkdir()
    (workspace / ".git" / "mine").write_text("the workspace's\n")
    real_step = oci_box._runtime_step

    async def swap_then_run(*args: Any) -> None:
        (workspace / ".git").rename(workspace / "moved")
        (workspace / ".git").symlink_to(hidden)
        await real_step(*args)

    monkeypatch.setattr(oci_box, "_runtime_step", swap_then_run)
    policy = Policy.from_dict(
        {**box_policy.model_dump(exclude_unset=True), "filesystem": {"deny_write": [".git"]}}
    )
    outcome: str
    try:
        async with Sandbox(policy, workspace=workspace) as sb:
            r = await sb.run(f"cat /workspace/.git/host-only {hidden}/host-only; ls {hidden}")
            outcome = r.stdout
    except SandboxError as exc:
        outcome = f"refused: {exc.message}"
    finally:
        shutil.rmtree(hidden)
    assert "host data" not in outcome, outcome
    if box_policy.runtime != "runsc":
        assert outcome.startswith("refused"), outcome  # the pins, or the runtime itself


async def test_runsc_mounts_a_writable_areas_source_from_a_staging_point_bound_by_fd(
    box_policy: Policy, workspace: Path
) -> None:
    """What gVisor's gofer opens for ``deny_write: [.git]`` is a root-owned staging mount
    point bound from the host's descriptor of ``<workspace>/.git``, not the workspace path:
    once it is made, swapping the workspace's ``.git`` for a link changes nothing there."""
    if box_policy.runtime != "runsc":
        pytest.skip("runc and crun are checked by the pins; bwrap mounts from the fd")
    (workspace / ".git").mkdir()
    (workspace / ".git" / "mine").write_text("the workspace's\n")
    policy = Policy.from_dict(
        {**box_policy.model_dump(exclude_unset=True), "filesystem": {"deny_write": [".git"]}}
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        state_dir = state_root() / "boxes" / sb.sandbox_id
        config = json.loads((state_dir / "bundle" / "config.json").read_text())
        (source,) = [m["source"] for m in config["mounts"] if m["destination"] == "/workspace/.git"]
        assert source.startswith(str(state_root() / "mnt") + "/"), source
        (workspace / ".git").rename(workspace / "moved")
        (workspace / ".git").symlink_to("/etc")
        assert os.listdir(source) == ["mine"]  # the object opened, whatever the path is now
        assert (await sb.run("cat /workspace/moved/mine")).stdout == "the workspace's\n"
