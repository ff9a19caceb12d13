"""Host-side opens of paths a box can change: the one place corral (often as root) touches
a path inside a writable area.

The attacker is the box of yesterday: a workspace is reused box after box, so anything a box
leaves there (a symlink where a file was, a renamed parent directory, a FIFO) is waiting for
the next box's start and for host code. So:

* a path inside a writable area is opened relative to the fd of that area with
  ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` (or, where openat2 is missing, an
  ``O_NOFOLLOW`` walk one component at a time: :func:`corral.agent.files.open_beneath`):
  no symlink anywhere below the area's root is followed, and nothing leaves it;
* what is bound into a box is bound by that fd (``/proc/<pid>/fd/N`` as the source, or
  bwrap's ``--bind-fd``), so a path swapped between the check and the mount cannot
  redirect it;
* what a backend mounts *at* a path in a writable area (a mask, a nested share) is mounted
  by bwrap or the runtime by that path, inside the box's new root: a box running on the same
  workspace can swap a link into it between the host's check and the mount. :func:`pin`
  records the object each such mount must show, and :func:`check_pins` compares, once the
  box's mounts are built and before it runs anything, what the box sees there (resolved
  beneath the box's root, following no link) and refuses the box on any difference;
* files corral writes or reads for itself (the audit log, the secrets file) may not lie in a
  writable area at all: :func:`refuse_inside` raises a PolicyError naming the field and the
  fix (a box could otherwise make root append to a file of its choosing, or plant secrets).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from corral import errors
from corral.agent.files import _Openat2

_OPENAT2: _Openat2 | None = None


def _openat2() -> _Openat2:
    global _OPENAT2
    if _OPENAT2 is None:
        _OPENAT2 = _Openat2()
    return _OPENAT2


def _norm(path: str | os.PathLike[str]) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(path)))


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def area_of(path: str | os.PathLike[str], areas: Iterable[str | os.PathLike[str]]) -> str | None:
    """The writable area holding ``path`` (as spelled, or once the host's own symlinks are
    resolved: either counts), or None."""
    return area_finder(areas)(path)


def area_finder(
    areas: Iterable[str | os.PathLike[str]],
) -> Callable[[str | os.PathLike[str]], str | None]:
    """:func:`area_of` for many paths against the same areas: each area is resolved once
    (a box start checks ~40 bind sources; resolving every area again for each took ~1 ms)."""
    roots = [r for a in areas for r in dict.fromkeys((_norm(a), os.path.realpath(a)))]

    def find(path: str | os.PathLike[str]) -> str | None:
        spelled = _norm(path)
        real = os.path.realpath(spelled)
        for root in roots:
            if _within(spelled, root) or _within(real, root):
                return root
        return None

    return find


def open_beneath(root: str | os.PathLike[str], rel: str, flags: int, mode: int = 0) -> int:
    """``rel`` beneath the directory ``root``, following no symlink below ``root`` (ELOOP)
    and never leaving it (EXDEV). ``root`` itself is the host's choice and is resolved."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rel = rel.strip("/") or "."
        return _openat2().open(root_fd, rel, flags | os.O_CLOEXEC, mode, no_symlinks=True)
    finally:
        os.close(root_fd)


def open_path(
    path: str | os.PathLike[str],
    flags: int,
    areas: Iterable[str | os.PathLike[str]],
    mode: int = 0,
) -> int:
    """Open a host path; beneath its writable area without following symlinks when it lies
    in one (see :func:`open_beneath`), plainly otherwise (the box cannot change it)."""
    spelled = _norm(path)
    area = area_of(spelled, areas)
    if area is None:
        return os.open(spelled, flags | os.O_CLOEXEC, mode)
    real = os.path.realpath(area)
    rel = os.path.relpath(spelled, area) if _within(spelled, area) else None
    if rel is None:
        rel = os.path.relpath(os.path.realpath(spelled), real)
    return open_beneath(real, rel, flags, mode)


Pinned = tuple[str, int, int]
"""A guest path and the ``(st_dev, st_ino)`` the box must see there."""


def pin(dest: str, source: str, areas: Iterable[str | os.PathLike[str]]) -> Pinned:
    """What ``dest`` must be once the box is built: the object at ``source`` (opened beneath
    its writable area following no link when it lies in one; OSError otherwise)."""
    fd = open_path(source, os.O_PATH, areas)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return (dest, st.st_dev, st.st_ino)


def check_pins(pid: int, pins: Iterable[Pinned]) -> None:
    """A PolicyError unless each pinned guest path, seen from the root of process ``pid``
    (a process of the box) without following any link, is the object pinned: a mask or
    share redirected by a link a box swapped in while this box started (bwrap and the
    runtimes resolve destinations by path) fails the start instead of masking something
    else and leaving the real path open."""
    pins = list(pins)
    if not pins:
        return
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for dest, dev, ino in pins:
            try:
                fd = _openat2().open(root, dest.strip("/") or ".", os.O_PATH, 0, no_symlinks=True)
            except OSError as exc:
                raise errors.PolicyError(
                    f"{dest}: the box's mount there cannot be reached without following a link "
                    f"({exc.strerror}; swapped in by another box on the same workspace?); the "
                    "box was not started"
                ) from None
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise errors.PolicyError(
                    f"{dest}: what the box got there is not what the host opened: its path in a "
                    "writable area changed while the box started (swapped by another box on "
                    "the same workspace?); the box was not started"
                )
    finally:
        os.close(root)


def fd_source(fd: int) -> str:
    """A bind source that is the object ``fd`` holds, whatever its path is renamed to: the
    magic link of corral's own fd (valid while corral keeps ``fd`` open)."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def refuse_inside(field: str, path: Path | None, areas: Sequence[str | os.PathLike[str]]) -> None:
    """A PolicyError when a file corral itself uses (``audit_log``, ``secrets_file``) lies in
    an area a box can write: the box could swap it for a symlink to any host file."""
    if path is None:
        return
    area = area_of(path, areas)
    if area is not None:
        raise errors.PolicyError(
            f"{field} {path} is inside {area}, which the box can write: a box could replace "
            f"it with a link to any host file; put {field} outside the workspace and every "
            "allow_write or rw mount path (for example under /var/log or ~/.config/corral)"
        )


def refuse_writable_policy(path: Path | None, areas: Sequence[str | os.PathLike[str]]) -> None:
    """A PolicyError when the policy file a box's policy was loaded from lies in an area
    that box can write: it could rewrite the policy (mounts, network, limits) that the next
    run on this workspace loads."""
    if path is None:
        return
    area = area_of(path, areas)
    if area is not None:
        raise errors.PolicyError(
            f"policy file {path} is inside {area}, which the box can write: a box could "
            "rewrite the policy a later run loads (its mounts, network, limits); keep the "
            "policy outside the workspace and every allow_write or rw mount path, or take it "
            "anyway with --trust-writable-policy (Policy.load(path, trust_writable=True)) "
            "if you review it before each run"
        )


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """Open a file corral itself reads or appends to: no symlink as the last component, no
    FIFO to block on, nothing but a regular file (an OSError otherwise)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_beneath(root: str | os.PathLike[str], rel: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``rel`` beneath ``root`` (see
    :func:`open_beneath`: no symlink followed), or None when it is anything else or cannot
    be read: a box can leave a link to ``/dev/zero`` or a FIFO where host code reads a
    small file of its workspace (a venv's ``pyvenv.cfg``), which must not make that code
    read without end, or block, as root."""
    try:
        fd = open_beneath(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def make_dirs(area: str | os.PathLike[str], rel: str) -> None:
    """Create the directories of ``rel`` beneath the writable ``area`` (mode 0755, owned like
    the area), following no symlink: a mount point for a mask on a path not there yet."""
    root_st = os.stat(area)
    current = "."
    for part in rel.strip("/").split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise OSError(errno.EXDEV, "path leaves the writable area", rel)
        parent = open_beneath(area, current, os.O_PATH | os.O_DIRECTORY)
        try:
            try:
                os.mkdir(part, 0o755, dir_fd=parent)
                os.chown(part, root_st.st_uid, root_st.st_gid, dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                pass
        finally:
            os.close(parent)
        current = f"{current}/{part}"
    os.close(open_beneath(area, current, os.O_PATH | os.O_DIRECTORY))  # a directory, no link


def is_dir(path: str | os.PathLike[str], areas: Iterable[str | os.PathLike[str]]) -> bool:
    """Whether ``path`` is a directory, following no symlink inside ``areas``."""
    try:
        os.close(open_path(path, os.O_PATH | os.O_DIRECTORY, areas))
    except OSError:
        return False
    return True


def check_sources(named: Sequence[tuple[str, str]], areas: Sequence[str]) -> None:
    """Refuse (PolicyError naming the field) a ``mounts`` source or ``allow_write`` path
    (``named``: field -> host path) inside another writable area that is, or passes
    through, a symlink: an earlier box could have made it point at any host directory."""
    for field, path in named:
        others = [a for a in areas if _norm(a) != _norm(path)]
        if area_of(path, others) is None:
            continue
        try:
            os.close(open_path(path, os.O_PATH, others))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                continue  # nothing there: Sandbox.start refused it already
            raise errors.PolicyError(
                f"{field} {path} lies in a writable area and cannot be opened without "
                f"following a link ({exc.strerror}; left by an earlier box?): remove the link "
                "or point the field at a path outside the workspace"
            ) from None


def placeholder_maker(
    workspace: str | os.PathLike[str], shown: str | os.PathLike[str], sources: dict[str, str]
) -> Callable[[str, str], None]:
    """:func:`make_dirs` on the real host directory of a writable area the layout names by
    its idmapped mount point (``shown`` for the workspace, ``sources`` for the rest): a
    directory made through an idmapped mount as root has no owner it can map (EOVERFLOW)."""
    real = {os.fspath(shown): os.fspath(workspace)}
    real.update({mounted: host for host, mounted in sources.items()})

    def make(area: str, rel: str) -> None:
        make_dirs(real.get(area, area), rel)

    return make
