"""A warm pool: boxes started ahead of time, handed out with the caller's workspace.

Starting a box costs tens of milliseconds (namespaces, mounts, the guest agent's Python);
running a command in a started box costs about two. A :class:`SandboxPool` keeps ``size``
boxes started for one policy, and binds the caller's workspace into one when it is claimed::

    async with corral.SandboxPool(policy, size=2) as pool:
        result = await pool.run(["pytest", "-q"], workspace="/src/app")   # one-shot
        async with await pool.sandbox(workspace="/src/app") as sb:        # a whole session
            ...

How the workspace gets into a box that is already running: each pooled box binds a host
*staging* directory (``<state>/pool/<id>/ws``) at its workdir. The staging directory is made a
shared mount before the box starts, so the box's copy of it is a slave of the host's; binding
the workspace onto the staging directory at claim time propagates into the box (and never
back out). Release kills every process of the box first, then unmounts. A staging directory
is only ever ``rmdir``-ed, never removed recursively, so a crash can't delete a workspace.

Limits: the bwrap backend only; policies with workspace-relative ``deny_read``/``deny_write``
entries (applied when a box starts) and workspaces owned by another user than the pool's
(box uid 1000 maps to the owner when the box starts) get a fresh box instead, transparently.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path
from types import TracebackType

from corral import errors
from corral.backends import backend_for
from corral.backends.base import Backend
from corral.backends.host import idmap, mounts, quota, tempws
from corral.backends.host.staging import new_entry, release_staging, sweep_staging
from corral.backends.host.state import BOX_PREFIX
from corral.backends.host.threads import blocking
from corral.backends.layout import HostView, expand, guest_path
from corral.backends.users import COMMAND_HOST_ID
from corral.models import CommandResult
from corral.policy import Policy, RlimitName
from corral.sandbox import Command, Sandbox, as_policy
from corral.workspaces import refuse_dangerous_workspace


def needs_fresh_box(policy: Policy) -> str | None:
    """Why boxes of this policy can't be pooled, or None."""
    if policy.backend != "bwrap":
        return f"the warm pool supports the bwrap backend, not {policy.backend!r}"
    if os.geteuid() != 0:
        return "the warm pool needs root (its staging mounts); rootless boxes start fresh"
    fs = policy.filesystem
    if policy.for_workspace("/") is not policy:
        return "relative allow_write or mount paths are resolved when a box starts"
    for raw in (*fs.deny_read, *fs.deny_write):
        guest = guest_path(raw, policy, HostView())
        if guest == policy.workdir or guest.startswith(policy.workdir.rstrip("/") + "/"):
            return f"deny entry {raw!r} lies in the workspace and is applied when a box starts"
    return None


def _holds_venv(workspace: Path) -> bool:
    """Whether ``workspace`` holds a Python venv (``pyvenv.cfg`` at its top or one level
    down). A venv's scripts name the workspace's host path in their ``#!``, which a fresh
    box links to the workdir and a warm box, started before the workspace was known, can't.
    Only names are read (``scandir``, no link followed)."""
    try:
        with os.scandir(workspace) as entries:
            for entry in entries:
                if entry.name == "pyvenv.cfg" and entry.is_file(follow_symlinks=False):
                    return True
                if entry.is_dir(follow_symlinks=False) and _regular(entry.path + "/pyvenv.cfg"):
                    return True
    except OSError:
        return False
    return False


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _holds_masked(policy: Policy, workspace: Path) -> bool:
    """Whether a masked host path lies inside ``workspace`` (by st_dev/st_ino of its
    ancestors: workspace = $HOME holds ~/.ssh). A warm box's masks were laid out before the
    workspace was known, so such a workspace gets a fresh box, whose masks follow the object
    to /workspace/.ssh (:func:`corral.backends.layout.policy_binds`)."""
    try:
        st = workspace.stat()
    except OSError:
        return False
    home = os.path.expanduser("~")
    for raw in (*policy.filesystem.deny_read, *policy.filesystem.deny_write):
        path = Path(expand(raw, home) if raw.startswith(("/", "~")) else "/")
        for ancestor in (path, *path.parents):
            try:
                a = ancestor.stat()
            except OSError:
                continue
            if (a.st_dev, a.st_ino) == (st.st_dev, st.st_ino) and ancestor != Path("/"):
                return True
    return False


POOL_FIX = (
    "Give a project directory, or no workspace for a fresh temporary one; to share it "
    "anyway, use Sandbox(..., allow_dangerous_workspace=True)"
)


def _workspace(workspace: str | os.PathLike[str] | None) -> Path | None:
    ws = Path(workspace).resolve() if workspace is not None else None
    if ws is not None and not ws.is_dir():
        raise errors.SandboxError(
            f"workspace {ws} is not a directory; create it or pick another",
            code=errors.ErrorCode.INVALID_INPUT,
        )
    return ws


def _bind_restricted(source: Path, staging: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="attach-", dir=staging.parent.parent))
    try:
        mounts.bind(str(source), str(scratch))
        try:
            mounts.restrict(str(scratch))
            mounts.bind(str(scratch), str(staging))
        finally:
            mounts.umount(str(scratch))
    finally:
        scratch.rmdir()


class SandboxPool:
    """Boxes of one policy, started ahead of time. Use as ``async with SandboxPool(...)``."""

    def __init__(
        self,
        policy: Policy | str | os.PathLike[str] | None = None,
        *,
        size: int = 2,
        owner: tuple[int, int] | None = None,
        backend: Backend | None = None,
    ) -> None:
        if size < 1:
            raise errors.SandboxError(
                f"pool size must be at least 1, got {size}", code=errors.ErrorCode.INVALID_INPUT
            )
        self.policy = as_policy(policy)
        fixed = [p for p in self.policy.network.publish if p.port_on_host != 0]
        if fixed:
            raise errors.PolicyError(
                f"a pool's boxes cannot all publish on host port {fixed[0].port_on_host}: "
                "publish on host port 0 (any free one; see Sandbox.published) or use a Sandbox"
            )
        if quota.asked(self.policy):
            raise errors.PolicyError(
                "filesystem.workspace_size/workspace_inodes: a pool's boxes take host "
                "directories as workspaces, which corral cannot cap; use a Sandbox without "
                "workspace= for a capped temporary workspace"
            )
        self.size = size
        self.owner = owner or (os.getuid(), os.getgid())
        """Workspaces of this uid/gid are served warm; others get a fresh box."""
        self._why_fresh = needs_fresh_box(self.policy)
        self._backend = backend
        self._ready: list[Sandbox] = []
        self._filling: set[asyncio.Task[None]] = set()
        self._pending = 0
        self._teardown: set[asyncio.Task[None]] = set()
        self._idmapped = False
        self._fill_error: BaseException | None = None
        self._closed = False
        self._wake = asyncio.Event()
        self._staging: dict[Sandbox, Path] = {}
        """Pooled sandboxes -> their staging directory (``<entry>/ws``, the box's workdir)."""

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def ready(self) -> int:
        """Boxes started and waiting to be claimed."""
        return len(self._ready)

    async def start(self) -> None:
        """Fill the pool and return once every box is ready (errors of the first start raise)."""
        await blocking(sweep_staging)
        if self._why_fresh is not None:
            return
        self._idmapped = await blocking(idmap.unsupported_reason) is None
        if self._backend is None:
            # One backend for every box of the pool: its orphan sweep runs once, not per box.
            self._backend = await blocking(backend_for, self.policy)
        boxes = await asyncio.gather(
            *(self._make() for _ in range(self.size)), return_exceptions=True
        )
        for box in boxes:
            if isinstance(box, BaseException):
                for other in boxes:
                    if isinstance(other, Sandbox):
                        await self._discard(other)
                raise box
            self._ready.append(box)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every box is ready again and every released one is torn down (between
        bursts of work; benchmarks and tests use it). Raises the refill's error if any."""
        async with asyncio.timeout(timeout):
            while len(self._ready) < self.size and self._why_fresh is None:
                if self._fill_error is not None:
                    raise self._fill_error
                self._wake.clear()
                await self._wake.wait()
            await asyncio.gather(*self._teardown, return_exceptions=True)

    async def sandbox(self, workspace: str | os.PathLike[str] | None = None) -> Sandbox:
        """A started sandbox with ``workspace`` at the policy's workdir (closing it is yours)."""
        sb = await self._claim(workspace)
        self._staging.pop(sb, None)  # the caller closes it: released as any sandbox is
        self._refill()
        return sb

    async def _claim(self, workspace: str | os.PathLike[str] | None) -> Sandbox:
        if self._closed:
            raise errors.SandboxClosed("the pool is closed")
        ws = _workspace(workspace)
        if self._why_fresh is not None or (
            ws is not None
            and (self._foreign(ws) or _holds_masked(self.policy, ws) or _holds_venv(ws))
        ):
            return await self._fresh(ws)
        box = self._ready.pop() if self._ready else await self._make()
        try:
            await blocking(self._attach, box, ws)
        except BaseException:
            await self._discard(box)
            # A claim cancelled (or failed) after taking a ready box refills as a finished
            # one does: otherwise the pool held one box less for good, and wait_idle()
            # waited for a box nothing would start.
            self._refill()
            raise
        return box

    async def run(
        self,
        cmd: Command,
        *,
        workspace: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        rlimits: dict[RlimitName, int] | None = None,
        check: bool = False,
    ) -> CommandResult:
        """One command in a box of the pool, which is closed afterwards (a one-shot); the
        arguments after ``workspace`` are ``Sandbox.run``'s."""
        sb = await self._claim(workspace)
        try:
            return await sb.run(
                cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, rlimits=rlimits, check=check
            )
        finally:
            await self._release(sb)
            # Refilled only now: a box starting competes for the CPU with the command.
            self._refill()

    async def _release(self, sb: Sandbox) -> None:
        """Stop the box now and hand the workspace back; tear it down in the background.

        After ``stop`` no process of the box runs again, so nothing touches the workspace
        once this returns; waiting for the namespaces to die (several ms) is the slow part
        and need not delay the caller. :meth:`aclose` waits for every teardown."""
        staging = self._staging.pop(sb, None)
        if staging is not None:
            sb.stop()
            with contextlib.suppress(OSError):
                await blocking(mounts.umount, str(staging))  # waits for a grace period
        task = asyncio.get_running_loop().create_task(sb.aclose())
        self._teardown.add(task)
        task.add_done_callback(self._teardown.discard)

    async def aclose(self) -> None:
        """Close every waiting box; claimed sandboxes stay their owners' to close."""
        if self._closed:
            return
        self._closed = True
        # Boxes being started are waited for, not cancelled (each start is bounded): asyncio
        # can hang cancelling a subprocess mid-spawn. _fill_one closes them when it sees
        # the pool closed.
        await asyncio.gather(*self._filling, return_exceptions=True)
        boxes, self._ready = self._ready, []
        await asyncio.gather(*(self._discard(b) for b in boxes), return_exceptions=True)
        await asyncio.gather(*self._teardown, return_exceptions=True)

    # ---- internals ------------------------------------------------------------------------
    def _foreign(self, ws: Path) -> bool:
        if self._idmapped:
            return False  # every owner's workspace is idmapped onto the box user
        st = ws.stat()
        return (st.st_uid, st.st_gid) != self.owner

    async def _fresh(self, ws: Path | None) -> Sandbox:
        sb = Sandbox(self.policy, workspace=ws, backend=self._backend)
        await sb.start()
        return sb

    async def _make(self) -> Sandbox:
        # In a thread (mount calls wait for grace periods); a cancellation waits for it, and
        # what it made is released.
        made: list[Path] = []
        try:
            await blocking(self._new_staging, made)
        except BaseException:
            for entry in made:
                await blocking(release_staging, entry)
            raise
        staging = made[0]
        sb = Sandbox.on_staging(
            self.policy,
            staging / "ws",
            backend=self._backend,
            release=lambda: release_staging(staging),
        )
        try:
            await sb.start()
        except BaseException:
            await sb.aclose()
            raise
        self._staging[sb] = staging / "ws"
        return sb

    def _new_staging(self, made: list[Path]) -> None:
        entry = new_entry("pool", BOX_PREFIX + secrets.token_hex(6))
        made.append(entry)
        ws = entry / "ws"
        # Owned by whom the box user is on the host: the command ids, or (without
        # idmapping) the owner, whose workspaces are the only ones served warm.
        ids = (COMMAND_HOST_ID,) * 2 if self._idmapped else self.owner
        os.chown(ws, *ids)
        mounts.bind(str(ws), str(ws), recursive=False)
        mounts.make_shared(str(ws))

    def _attach(self, sb: Sandbox, ws: Path | None) -> None:
        """Mount the workspace (idmapped, or a plain bind where that is unavailable; nosuid,
        nodev) onto the box's staging directory."""
        assert sb.workspace is not None
        staging = sb.workspace
        owned: Path | None = None
        if ws is not None:  # here, in a thread: it reads the password database
            refuse_dangerous_workspace(ws, fix=POOL_FIX)
        if ws is None:
            owned = ws = tempws.make(sb.sandbox_id, self.owner)
        try:
            if self._idmapped:
                idmap.mount_idmapped(str(ws), str(staging), user=sb.user_host_ids[0])
            else:
                _bind_restricted(ws, staging)
        except BaseException:
            if owned is not None:
                tempws.remove(sb.sandbox_id, owned)
            raise
        sb.lend_workspace(ws, owned=owned is not None)

    def _refill(self) -> None:
        if self._closed or len(self._ready) + self._pending >= self.size:
            return
        self._pending += 1
        task = asyncio.get_running_loop().create_task(self._fill_one())
        self._filling.add(task)
        task.add_done_callback(self._filling.discard)

    async def _fill_one(self) -> None:
        try:
            box = await self._make()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fill_error = exc
            self._wake.set()
            return
        finally:
            # Counted here, not by task membership: a waiter may run before the task's
            # done-callbacks do.
            self._pending -= 1
        if self._closed:
            await self._discard(box)
            return
        self._fill_error = None
        self._ready.append(box)
        self._wake.set()

    async def _discard(self, sb: Sandbox) -> None:
        self._staging.pop(sb, None)
        await sb.aclose()
