"""Landlock on the agent itself, once, right after "ready": every command it starts later
inherits the domain (``fork`` and ``execve`` keep it; nothing can leave it), so a bind the
mount layout got wrong is still not writable, or not readable, from inside the box.

The host sends the rules (:func:`corral.backends.landlock.rules`): guest paths to read and
execute (``read``), to use fully (``write``: the workspace, /tmp, ``allow_write``...), and
the box's own /proc and /dev. Anything else a command opens by path is denied (EACCES),
whatever its mount allows. Network rules are not used (a box's own network namespace is the
boundary, and loopback servers inside it must keep working); ABI 6's scoping is: abstract
unix sockets and signals stay within the box's domain.

The syscalls go through :class:`libc.Libc` (``_ctypes`` alone: 0.8 ms to import).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any

    from corral.agent import libc as clib
elif __package__:  # the host (its tests): corral.agent.landlock
    from corral.agent import libc as clib
else:  # inside the box: a sibling module
    import libc as clib

# Syscall numbers: the same on every architecture since 5.x (new syscalls are numbered alike).
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2: unhandled, every rename or link across directories is denied
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
"""The rights a rule on a non-directory may name (any other: EINVAL)."""
READ = EXECUTE | READ_FILE | READ_DIR
PROC = READ_FILE | WRITE_FILE | READ_DIR


def handled_fs(abi: int) -> int:
    """Every filesystem right this ABI knows: all of them are handled (denied by default)."""
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def probe(libc: clib.Libc) -> tuple[int, str]:
    """(ABI version, "") when the kernel enforces Landlock, else (0, why not)."""
    import errno

    try:
        return libc.syscall("landlock_create_ruleset", CREATE_RULESET, None, 0, 1), ""
    except OSError as exc:
        if exc.errno == errno.ENOSYS:
            return 0, "the kernel has no Landlock (built without it, or not this kernel's API)"
        if exc.errno == errno.EOPNOTSUPP:
            return (
                0,
                "Landlock is built into the kernel but not enabled (boot with lsm=...,landlock)",
            )
        return 0, f"landlock_create_ruleset: {exc.strerror}"


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "little" if _LITTLE else "big")


_LITTLE = __import__("sys").byteorder == "little"


def apply(config: dict[str, Any], as_user: Any = None) -> dict[str, Any]:
    """Restrict the calling thread (the agent's only one that starts commands) to ``config``'s
    rules; what ``info()`` reports: ``{"abi": N, "enforced": bool, "reason": ...}``.
    ``as_user``: a context manager taking the command user's ids (for paths only they reach).

    A kernel without Landlock is reported, not an error; a kernel with it that refuses the
    rules raises OSError (the agent then serves nothing: no box without its layer)."""
    if "off" in config:
        return {"abi": 0, "enforced": False, "reason": str(config["off"])}
    libc = clib.Libc()
    abi, why = probe(libc)
    if abi < 1:
        return {"abi": 0, "enforced": False, "reason": why}
    if abi < 2:  # no REFER right: every rename across directories would fail (EXDEV)
        return {"abi": abi, "enforced": False, "reason": "Landlock ABI 1 is too old (needs 2+)"}
    fs = handled_fs(abi)
    attr = _u64(fs)
    scoped = 0
    if abi >= 6:
        scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        attr += _u64(0) + _u64(scoped)  # handled_access_net: none (see the module's text)
    ruleset = libc.syscall("landlock_create_ruleset", CREATE_RULESET, attr, len(attr), 0)
    try:
        for key, rights in (("read", READ), ("proc", PROC), ("write", fs)):
            for path in config.get(key) or ():
                _add(libc, ruleset, str(path), rights & fs, as_user, key == "write")
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # bwrap and OCI set it already
        libc.syscall("landlock_restrict_self", RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
    status: dict[str, Any] = {"abi": abi, "enforced": True}
    if scoped:
        status["scoped"] = ["abstract_unix_socket", "signal"]
    return status


def _add(
    libc: clib.Libc, ruleset: int, path: str, rights: int, as_user: Any, whole: bool = False
) -> None:
    """One path-beneath rule; a path the box does not have is skipped, and so is one that
    neither the agent nor (``as_user()``) the command user can reach: no rule, no access.
    ``/`` gives names only (listing), unless ``whole`` (a ``write`` rule: a box whose root
    is its own writable overlay)."""
    import stat

    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return
    except PermissionError:  # box root has no DAC override: a directory only uid 1000 enters
        if as_user is None:
            return
        try:
            with as_user():
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
    try:
        if path == "/" and not whole:  # names only: listing / works, its files stay the
            rights &= READ_DIR  # rules' own
        elif not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_ONLY
        # struct landlock_path_beneath_attr (packed): __u64 allowed_access, __s32 parent_fd.
        rule = _u64(rights) + fd.to_bytes(4, "little" if _LITTLE else "big", signed=True)
        libc.syscall("landlock_add_rule", ADD_RULE, ruleset, RULE_PATH_BENEATH, rule, 0)
    finally:
        os.close(fd)
