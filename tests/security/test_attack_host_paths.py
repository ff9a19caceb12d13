"""The box of yesterday: what a box leaves in a writable area for the next box's start and for
host code (issue 13, classes 1-3). Most attacks need two boxes in sequence on the same
workspace: the first plants a symlink, removes a masked path or leaves a special file; the
second box's start, or the host, must not follow it.

Each asserts the refusal (a PolicyError naming the field, ``not_a_regular_file``, a mask at
every path) and, through ``host_guard``, that the host's canary files are unchanged."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from corral import NotARegularFile, Policy, PolicyError, Sandbox
from corral.audit import AuditLog
from corral.backends import layout
from corral.backends.microvm import vmsnap
from corral.errors import BackendError, FileOpError
from corral.policy import Mount
from corral.tools.secrets import SecretStore
from security.conftest import Canary
from security.helpers import box_py

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

BOUND = 15  # seconds: a refusal is immediate; only a hang (the old FIFO read) reaches this


async def _in_box(policy: Policy, workspace: Path, script: str) -> None:
    """One earlier box on ``workspace`` runs ``script`` (its attack) and is closed."""
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["sh", "-c", script])
        assert r.exit_code == 0, r.stderr


async def _refused(policy: Policy, workspace: Path, field: str) -> str:
    with pytest.raises(PolicyError) as info:
        async with Sandbox(policy, workspace=workspace):
            pass
    assert field in info.value.message, info.value.message
    return info.value.message


# ---- class 1: host code following box-controlled paths ------------------------------------


async def test_audit_log_inside_the_workspace_is_refused(
    box_policy: Policy, workspace: Path
) -> None:
    """Root appends to the audit log: in the workspace, a box could make it a link to any
    host file (``/etc/passwd``) for the next box's records."""
    policy = box_policy.model_copy(update={"audit_log": workspace / "logs" / "audit.jsonl"})
    message = await _refused(policy, workspace, "audit_log")
    assert "outside the workspace" in message
    assert not (workspace / "logs").exists()


async def test_secrets_file_inside_the_workspace_is_refused(
    box_policy: Policy, workspace: Path
) -> None:
    (workspace / "secrets.env").write_text("TOKEN=abc\n")
    policy = box_policy.model_copy(update={"secrets_file": workspace / "secrets.env"})
    await _refused(policy, workspace, "secrets_file")


def test_audit_log_that_is_a_symlink_is_not_followed(tmp_path: Path, canary: Canary) -> None:
    """A link where the audit log should be: nothing is appended to the file it names."""
    log = tmp_path / "audit.jsonl"
    log.symlink_to(canary.file)
    audit = AuditLog(log, "sb-test")
    audit.record("command", argv=["box-chosen text"])
    audit.close()
    assert canary.file.read_text() == canary.content


def test_audit_log_that_is_a_fifo_does_not_block(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    os.mkfifo(log)
    audit = AuditLog(log, "sb-test")
    audit.record("command", argv=["x"])  # O_NONBLOCK: ENXIO, dropped, not a hang
    audit.close()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_secrets_file_that_is_a_link_or_fifo_is_refused(
    tmp_path: Path, canary: Canary, kind: str
) -> None:
    path = tmp_path / "secrets.env"
    if kind == "symlink":
        path.symlink_to(canary.file)
    else:
        os.mkfifo(path)
    with pytest.raises(PolicyError, match="secrets file"):
        SecretStore.from_file(path)


def test_policy_file_that_is_a_fifo_does_not_hang_the_cli(tmp_path: Path) -> None:
    """``corral run --policy ws/corral.toml`` after a box made it a FIFO: refused, at once."""
    path = tmp_path / "corral.toml"
    os.mkfifo(path)
    with pytest.raises(PolicyError, match="not a regular file"):
        Policy.load(path)


@pytest.mark.parametrize("link_at", ["source", "parent"])
async def test_mount_source_swapped_for_a_symlink_is_refused(
    box_policy: Policy, workspace: Path, canary: Canary, link_at: str
) -> None:
    """A policy sharing ``<workspace>/shared/tmp`` read-write: box one replaces it by a link
    to a host directory (or its parent by a link to /var); box two must not get /var/tmp."""
    (workspace / "shared" / "tmp").mkdir(parents=True)
    mount = Mount(host=workspace / "shared" / "tmp", guest="/data", mode="rw")
    policy = box_policy.model_copy(
        update={"filesystem": box_policy.filesystem.model_copy(update={"mounts": (mount,)})}
    )
    if link_at == "source":
        swap = f"rm -rf /workspace/shared/tmp && ln -s {canary.dir} /workspace/shared/tmp"
    else:
        swap = "mv /workspace/shared /workspace/old && ln -s /var /workspace/shared"
    await _in_box(box_policy, workspace, swap)
    message = await _refused(policy, workspace, "filesystem.mounts[0].host")
    assert "link" in message


async def test_deny_write_path_removed_by_an_earlier_box_stays_unwritable(
    box_policy: Policy, workspace: Path
) -> None:
    """``deny_write: [.git]`` protects hooks the host's git runs; a box that removed ``.git``
    must not let the next box create ``.git/hooks/post-commit``."""
    (workspace / ".git" / "hooks").mkdir(parents=True)
    await _in_box(box_policy, workspace, "rm -rf /workspace/.git")
    policy = box_policy.model_copy(
        update={"filesystem": box_policy.filesystem.model_copy(update={"deny_write": (".git",)})}
    )
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(
            ["sh", "-c", "mkdir -p /workspace/.git/hooks && echo evil > /workspace/.git/hooks/x"]
        )
        assert r.exit_code != 0
    assert not (workspace / ".git" / "hooks").exists()
    assert not any(p.is_file() for p in (workspace / ".git").rglob("*"))


@pytest.mark.parametrize("field", ["deny_write", "deny_read"])
async def test_mask_target_swapped_for_a_symlink_fails_closed(
    box_policy: Policy, workspace: Path, canary: Canary, field: str
) -> None:
    (workspace / "private").mkdir()
    (workspace / "private" / "key").write_text("secret\n")
    await _in_box(
        box_policy,
        workspace,
        f"mv /workspace/private /workspace/moved && ln -s {canary.dir} /workspace/private",
    )
    fs = box_policy.filesystem.model_copy(update={field: ("private",)})
    await _refused(box_policy.model_copy(update={"filesystem": fs}), workspace, field)


@pytest.mark.parametrize("field", ["deny_write", "deny_read"])
async def test_mask_below_a_renamed_parent_fails_closed(
    box_policy: Policy, workspace: Path, field: str
) -> None:
    """``private/key`` masked; box one makes ``private`` a link to a directory it controls."""
    (workspace / "private").mkdir()
    (workspace / "private" / "key").write_text("secret\n")
    await _in_box(
        box_policy,
        workspace,
        "mv /workspace/private /workspace/moved && ln -s moved /workspace/private",
    )
    fs = box_policy.filesystem.model_copy(update={field: ("private/key",)})
    await _refused(box_policy.model_copy(update={"filesystem": fs}), workspace, field)


@pytest.mark.parametrize("field", ["deny_write", "deny_read"])
async def test_mask_path_swapped_after_the_hosts_check_fails_closed(
    box_policy: Policy, workspace: Path, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two boxes at once on one workspace: box one swaps ``private`` for a link (to the
    directory it renamed) after box two's host-side check passed and before bwrap or the
    runtime mounts the mask, which they do by path: the mask would land on the link's
    target, and a swap back would leave ``private/key`` open. The start is refused once the
    box is built, before it runs anything. (The race is made certain: the host's check
    runs before the swap, here by being skipped.)"""
    if box_policy.runtime == "runsc":
        pytest.skip("gVisor's gofer makes masks its own way")
    (workspace / "private").mkdir()
    (workspace / "private" / "key").write_text("secret\n")
    (workspace / "private").rename(workspace / "moved")
    (workspace / "private").symlink_to("moved")
    monkeypatch.setattr(layout, "_no_link_below", lambda *args: None)
    fs = box_policy.filesystem.model_copy(update={field: ("private/key",)})
    if box_policy.backend == "microvm":
        # The guest checks its own mounts (its init, before the agent serves): the boot
        # fails (or its mount through the link already did), with the init's sentence. The
        # refusal is the box's doing: the saved VM it was restored from is kept for the
        # next box, not dropped as if it were damaged.
        async with Sandbox(box_policy, workspace=workspace):
            pass  # a saved VM of this shape exists from here on
        saved = {p.name: p.stat().st_ino for p in vmsnap.snapshot_dir().iterdir()}
        with pytest.raises(BackendError, match="corral-init") as refused:
            async with Sandbox(
                box_policy.model_copy(update={"filesystem": fs}), workspace=workspace
            ):
                pass
        # Either the mount over the link fails outright (which a damaged saved VM could cause
        # too: that one is booted again), or the mount follows it and the init's check
        # refuses the layout: then the saved VM stays.
        if "corral-init: refused:" in refused.value.message:
            kept = {p.name: p.stat().st_ino for p in vmsnap.snapshot_dir().iterdir()}
            assert saved.items() <= kept.items(), (saved, kept)
        return
    with pytest.raises(PolicyError, match="link") as info:
        async with Sandbox(box_policy.model_copy(update={"filesystem": fs}), workspace=workspace):
            pass
    assert "private" in info.value.message, info.value.message


# ---- class 2: files a box leaves -------------------------------------------------------------


def _special_files_held(sb: Sandbox, exit_code: int, stderr: str) -> None:
    """The microVM's workspace is a 9p share, which holds no FIFO or socket (ENXIO): the
    attack cannot be set up there. Elsewhere making one must work."""
    if sb.policy.backend == "microvm" and exit_code != 0 and "No such device" in stderr:
        pytest.skip("the microVM's 9p workspace holds no FIFOs or sockets (ENXIO)")
    assert exit_code == 0, stderr


async def test_fifo_read_through_the_file_tools_is_refused_at_once(
    sandbox: Sandbox, workspace: Path
) -> None:
    r = await sandbox.run(["mkfifo", "/workspace/pipe"])
    _special_files_held(sandbox, r.exit_code, r.stderr)
    with pytest.raises(NotARegularFile, match="fifo"):
        await asyncio.wait_for(sandbox.files.read("/workspace/pipe"), BOUND)
    with pytest.raises(NotARegularFile):
        await asyncio.wait_for(sandbox.files.write("/workspace/pipe", b"x"), BOUND)
    assert (await sandbox.run(["true"])).exit_code == 0  # the agent still serves


async def test_socket_read_through_the_file_tools_is_refused(sandbox: Sandbox) -> None:
    code = "import socket; s = socket.socket(socket.AF_UNIX); s.bind('/workspace/sock')"
    r = await sandbox.run(["python3", "-c", code])
    _special_files_held(sandbox, r.exit_code, r.stderr)
    with pytest.raises(NotARegularFile):
        await asyncio.wait_for(sandbox.files.read("/workspace/sock"), BOUND)
    with pytest.raises(NotARegularFile):
        await asyncio.wait_for(sandbox.files.write("/workspace/sock", b"x"), BOUND)


async def test_device_node_in_the_workspace_is_not_read_as_a_file(
    sandbox: Sandbox, workspace: Path
) -> None:
    """A device node in the workspace (host-made: the box cannot mknod) reads as nothing."""
    if os.geteuid() != 0:
        pytest.skip(
            "rootless: no device node can be in the workspace (neither the user nor the box "
            "may mknod one); the FIFO and socket cases beside this test run"
        )
    os.mknod(workspace / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    with pytest.raises(FileOpError) as info:
        await asyncio.wait_for(sandbox.files.read("/workspace/zero", max_bytes=16), BOUND)
    assert info.value.code in ("not_a_regular_file", "permission_denied")


# ---- class 3: credentials reachable by another path ----------------------------------------


@pytest.mark.parametrize("kind", ["dir", "file"])
async def test_mask_follows_the_host_object_into_the_workspace(
    box_policy: Policy, tmp_path: Path, kind: str
) -> None:
    """Workspace = a home directory: ``~/.ssh`` masked at its host path must be masked at
    ``/workspace/.ssh`` too (the same inode), neither readable nor writable there."""
    home = tmp_path / "home"
    home.mkdir()
    if kind == "dir":
        target = home / ".ssh"
        target.mkdir()
        (target / "id_ed25519").write_text("PRIVATE KEY\n")
        inside, probe = "/workspace/.ssh", "/workspace/.ssh/id_ed25519"
    else:
        target = home / ".netrc"
        target.write_text("machine x password PRIVATE KEY\n")
        inside, probe = "/workspace/.netrc", "/workspace/.netrc"
    fs = box_policy.filesystem.model_copy(update={"deny_read": (str(target),)})
    policy = box_policy.model_copy(update={"filesystem": fs})
    async with Sandbox(policy, workspace=home) as sb:
        r = await sb.run(["sh", "-c", f"cat {probe}; ls -a {inside}; echo k >> {probe}"])
        assert "PRIVATE KEY" not in r.stdout
        assert "id_ed25519" not in r.stdout
    assert "k\n" not in (target / "id_ed25519" if kind == "dir" else target).read_text()


SET_ID_ATTEMPTS = """
import os, stat, shutil
res = {}
shutil.copy('/bin/true', '/workspace/suid')
res['chmod'] = err(os.chmod, '/workspace/suid', 0o4755)
res['chmod_setgid'] = err(os.chmod, '/workspace/suid', 0o2755)
fd = os.open('/workspace/suid', os.O_RDONLY)
res['fchmod'] = err(os.fchmod, fd, 0o4755)
os.close(fd)
res['create'] = err(lambda: os.close(os.open('/workspace/made', os.O_WRONLY | os.O_CREAT, 0o6755)))
res['mknod'] = err(os.mknod, '/workspace/node', stat.S_IFREG | 0o4755)
res['install'] = os.system('install -m 4755 /bin/true /workspace/inst 2>/dev/null')
"""


async def test_no_setuid_file_survives_the_box(sandbox: Sandbox, workspace: Path) -> None:
    """A box must not leave a setuid or setgid file in the workspace for the host (its files
    are the workspace owner's there: root's, when root owns it)."""
    res = await box_py(sandbox, SET_ID_ATTEMPTS)
    assert {k: v for k, v in res.items() if v is not None}, res  # refusals, whatever errno
    assert res["chmod"] == "EPERM" and res["fchmod"] == "EPERM", res
    left = [
        p.name
        for p in workspace.iterdir()
        if p.exists() and p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID)
    ]
    assert left == [], f"setuid/setgid files left in the workspace: {left}"


async def test_a_warm_pool_box_masks_the_host_object_in_the_workspace(tmp_path: Path) -> None:
    """A warm box's masks are laid out before its workspace is known: a workspace holding a
    masked path (workspace = $HOME) gets a fresh box, with the mask at /workspace/.ssh."""
    from corral import SandboxPool

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY\n")
    policy = Policy.from_dict({"filesystem": {"deny_read": [str(home / ".ssh")]}})
    async with SandboxPool(policy, size=1) as pool:
        sb = await pool.sandbox(home)
        async with sb:
            r = await sb.run(["sh", "-c", "cat /workspace/.ssh/id_ed25519; ls -a /workspace"])
    assert "PRIVATE KEY" not in r.stdout
    assert ".ssh" in r.stdout  # the workspace itself is there, the key is not


@pytest.mark.parametrize("size", [None, 1 << 20])
def test_an_image_staging_entry_is_host_roots_until_its_mount_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int | None
) -> None:
    """The staging entry of a box's image root goes to the box's namespace owner uid (bwrap
    runs as it). Were it that uid's before host root mounts on ``entry/ws``, a process of
    that uid could swap ``ws`` for a link and have root mount the image (or an overlay) on
    any host path. Every mount onto it must find it root's, 0700; the box gets it after."""
    if os.geteuid() != 0:
        pytest.skip(
            "rootless: no host-root mount onto a staging entry exists; a rootless box's image "
            "is the user's own store, mounted by box root inside the box's own namespaces "
            "(tests/rootless/test_rootless_images.py)"
        )
    from corral.backends.host import mounts, overlay, staging
    from corral.backends.users import HOST_UID_BASE, ID_RANGE, OWNER_UID_BASE

    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    seen: list[tuple[int, int]] = []

    def spy(real: Any, target: int) -> Any:
        def call(*args: Any) -> Any:
            st = os.stat(Path(str(args[target])).parent)
            seen.append((st.st_uid, stat.S_IMODE(st.st_mode)))
            return real(*args)

        return call

    monkeypatch.setattr(mounts, "bind", spy(mounts.bind, 1))
    monkeypatch.setattr(overlay, "_overlay", spy(overlay._overlay, 0))
    entries: list[Path] = []
    owner = OWNER_UID_BASE + 4093
    ranges = [(0, HOST_UID_BASE, ID_RANGE)]
    try:
        root = overlay.mount_image_root(
            f"cb-staging-{size}", rootfs, entries, uids=ranges, gids=ranges, owner=owner, size=size
        )
        assert seen == [(0, 0o700)], seen
        assert root.root.parent.stat().st_uid == owner  # the box's, once mounted
    finally:
        for entry in entries:  # the overlay first
            staging.release_staging(entry)


async def test_a_mask_on_a_link_an_earlier_box_left_is_refused_naming_its_path(
    box_policy: Policy, workspace: Path
) -> None:
    """An earlier box replaced the masked ``.git`` with a link to ``/etc``: the mask is
    refused (it would land on the link's target), named as the box sees the path, not as
    corral's own staging mount of the workspace (a path the user never made)."""
    await _in_box(box_policy, workspace, "rm -rf .git && ln -s /etc .git")
    fs = box_policy.filesystem.model_copy(update={"deny_write": [".git"]})
    message = await _refused(box_policy.model_copy(update={"filesystem": fs}), workspace, ".git")
    assert f"{box_policy.workdir}/.git is a symlink in a writable area" in message, message
    assert "/run/corral" not in message, message
