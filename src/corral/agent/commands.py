"""Starting a command (its rlimits, its terminal, a clear sentence when it cannot start) and
ending one: signals to its process group, and the TERM, grace, KILL sequence of ``terminate``.

Signals are sent as the command user: the agent holds no CAP_KILL.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    import signal
    from typing import Any

    from corral.agent import files, libc, protocol
else:
    import _signal as signal  # signal's Python layer imports enum (see lean.py)

    import files
    import libc
    import protocol

POLL = 0.02
"""Seconds between two looks at a terminated group whose leader is reaped but whose other
members are not yet gone (nothing wakes the agent when a grandchild dies)."""
GIVE_UP = 2.0
"""Seconds after the SIGKILL when the exit is reported even if the group still shows (only a
process the command user cannot signal would stay)."""


def spawn_error(exc: OSError, program: str, cwd: str | None, path: str) -> tuple[str, str]:
    """(error code, sentence) for a command that could not start: ``command_not_found``,
    ``not_executable`` (the host makes both a result with exit 127 / 126, as a shell does)
    or ``spawn_failed`` (its working directory)."""
    import errno

    c = protocol.ErrorCode
    # The chdir's failure, not the exec's: a program named as its own working directory
    # (run_command "/workspace" in /workspace) is not executable, the directory is fine.
    if AT_CHDIR in getattr(exc, "__notes__", ()) or (
        cwd and exc.filename == cwd and program != cwd
    ):
        missing = exc.errno == errno.ENOENT
        what = "not found" if missing else exc.strerror or str(exc)
        return c.SPAWN_FAILED, f"working directory {cwd}: {what}"
    if isinstance(exc, FileNotFoundError):
        if "/" in program:
            return c.COMMAND_NOT_FOUND, f"{program}: no such file"
        return c.COMMAND_NOT_FOUND, f"{program}: command not found (PATH={path})"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.ENOEXEC, errno.EISDIR):
        import stat

        try:
            is_dir = "/" in program and stat.S_ISDIR(
                os.stat(os.path.join(cwd or "/", program)).st_mode
            )
        except OSError:
            is_dir = False
        why = "is a directory" if is_dir else exc.strerror or "permission denied"
        return c.NOT_EXECUTABLE, f"{program}: not executable ({why.lower()})"
    return c.SPAWN_FAILED, f"cannot start {program}: {exc.strerror or exc}"


AT_CHDIR = "corral: the child could not go to its working directory"
"""The note (PEP 678) on the OSError of a child that failed at its chdir, not its exec: the
error itself stays the one ``Popen`` raises (FileNotFoundError for a missing directory)."""


PIPE = -1
DEVNULL = -3
"""``stdin``/``stdout``/``stderr`` of :func:`start`: a new pipe, or ``/dev/null`` (as
``subprocess``'s); any other value is an open fd the child gets (a terminal's slave)."""


class Started:
    """A command :func:`start` started: its pid and the agent's ends of its pipes (raw fds,
    the caller's to close; None where the child got ``/dev/null`` or a given fd)."""

    __slots__ = ("pid", "stderr", "stdin", "stdout")

    def __init__(self, pid: int, stdin: int | None, stdout: int | None, stderr: int | None):
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr


def _fork_exec() -> Any:
    """``_posixsubprocess.fork_exec`` where its arguments are the ones :func:`start` passes
    (CPython 3.11 to 3.13, as their ``subprocess`` calls it), else None."""
    import sys

    if not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    try:
        import _posixsubprocess
    except ImportError:
        return None
    return _posixsubprocess.fork_exec


def start(
    argv: list[str],
    *,
    cwd: str | None,
    env: dict[str, str],
    uid: int,
    gid: int,
    new_session: bool,
    preexec: Any,
    stdin: int,
    stdout: int,
    stderr: int,
) -> Started:
    """``subprocess.Popen(argv, user=uid, group=gid, close_fds=True, ...)`` without
    importing ``subprocess``: the C call under it, with the same executable search, the
    same child (signals restored, every other fd closed) and the same ``OSError`` when the
    child cannot exec (``filename`` the program, or ``cwd`` when it could not go there).

    ``subprocess`` pulls ``signal``, ``enum``, ``threading`` and ``selectors`` into the agent:
    about 34 M instructions of every box's start-up (more than the interpreter's own), and
    2 MB more heap that every fork of the agent copies."""
    fork_exec = _fork_exec()
    ours: list[int] = []  # the agent's ends, closed here on failure
    theirs: list[int] = []  # the child's ends, closed here once it has them
    try:
        ends: list[int] = []
        for i, mode in enumerate((stdin, stdout, stderr)):
            if mode == PIPE:
                r, w = os.pipe()
                child, parent = (r, w) if i == 0 else (w, r)
                ours.append(parent)
                theirs.append(child)
                ends.append(parent)
            elif mode == DEVNULL:
                child = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                theirs.append(child)
                ends.append(-1)
            else:
                child = mode
                ends.append(-1)
            if i == 0:
                child_in = child
            elif i == 1:
                child_out = child
            else:
                child_err = child
        if fork_exec is None:  # an interpreter whose fork_exec :func:`start` does not know
            import subprocess

            pid = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                user=uid,
                group=gid,
                start_new_session=new_session,
                preexec_fn=preexec,
                close_fds=True,
                stdin=child_in,
                stdout=child_out,
                stderr=child_err,
            ).pid
        else:
            pid = _spawn(
                fork_exec,
                argv,
                cwd,
                env,
                uid,
                gid,
                new_session,
                preexec,
                (child_in, child_out, child_err),
            )
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return Started(pid, *(fd if fd >= 0 else None for fd in ends))


def _spawn(
    fork_exec: Any,
    argv: list[str],
    cwd: str | None,
    env: dict[str, str],
    uid: int,
    gid: int,
    new_session: bool,
    preexec: Any,
    stdio: tuple[int, int, int],
) -> int:
    """The POSIX half of ``Popen._execute_child`` (CPython 3.11): fork, exec, and the error
    the child reports through a pipe when it could not exec."""
    env_list = []
    for k, v in env.items():
        key = os.fsencode(k)
        if b"=" in key:
            raise ValueError("illegal environment variable name")
        env_list.append(key + b"=" + os.fsencode(v))
    program = os.fsencode(argv[0])
    if b"/" in program:
        executables: tuple[bytes, ...] = (program,)
    else:  # os.get_exec_path(env), as os._execvpe searches it
        path = env.get("PATH", os.defpath)
        executables = tuple(os.path.join(os.fsencode(d), program) for d in path.split(os.pathsep))
    err_r, err_w = os.pipe()
    try:
        try:
            pid: int = fork_exec(
                argv, executables,
                True, (err_w,),  # close_fds, but the error pipe
                None if cwd is None else os.fsencode(cwd), env_list,
                stdio[0], -1, -1, stdio[1], -1, stdio[2],  # the agent's ends are CLOEXEC
                err_r, err_w,
                True, new_session, -1,  # restore signals (SIGPIPE), setsid, no pgid
                gid, None, uid, -1,  # groups untouched (the agent has none), no umask
                preexec, True,  # allow vfork (CPython takes it only where it is safe)
            )  # fmt: skip
        finally:
            os.close(err_w)
        data = bytearray()
        while len(data) <= 50000:
            part = os.read(err_r, 50000)
            if not part:
                break
            data += part
    finally:
        os.close(err_r)
    if not data:
        return pid
    try:
        os.waitpid(pid, 0)  # it wrote why and exited
    except ChildProcessError:
        pass
    try:
        name, hex_errno, message = bytes(data).split(b":", 2)
        errno_num = int(hex_errno, 16)
    except ValueError:
        raise RuntimeError(f"bad exception data from the child: {bytes(data)!r}") from None
    if name != b"OSError" or not errno_num:
        raise RuntimeError(message.decode(errors="replace"))
    if message.startswith(b"noexec"):  # the child failed before its exec, at the chdir
        failed = OSError(errno_num, os.strerror(errno_num), cwd)
        note = getattr(failed, "add_note", None)  # 3.11: an older guest interpreter has none
        if note is not None:
            note(AT_CHDIR)
        raise failed
    raise OSError(errno_num, os.strerror(errno_num), argv[0])


def set_winsize(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


RLIMIT_NAMES = {
    "nofile": "RLIMIT_NOFILE",
    "fsize": "RLIMIT_FSIZE",
    "core": "RLIMIT_CORE",
    "nproc": "RLIMIT_NPROC",
    "as": "RLIMIT_AS",
    "cpu": "RLIMIT_CPU",
    "stack": "RLIMIT_STACK",
    "data": "RLIMIT_DATA",
    "memlock": "RLIMIT_MEMLOCK",
    "msgqueue": "RLIMIT_MSGQUEUE",
}
BOX_MSGQUEUE_BYTES = 128 << 10
"""POSIX message queue bytes all commands of one box may hold (its own user namespace's
count): one queue of the default size (10 x 8 KiB) fits."""


def set_inherited_rlimits(limits: dict[str, int]) -> dict[str, int]:
    """Set soft and hard limits on the agent itself, for its children to inherit."""
    import resource

    applied = {}
    for name, value in limits.items():
        try:
            resource.setrlimit(getattr(resource, RLIMIT_NAMES[name]), (value, value))
        except (OSError, ValueError):
            continue
        applied[name] = value
    return applied


def shed_exec_capabilities() -> bool:
    """Empty the agent's ambient and inheritable capability sets (bwrap raises CAP_SETUID
    and CAP_SETGID in both, for box root); True when no ambient one is left. No command
    needs them: a program whose file grants inheritable capabilities would get them, and
    any spawn that keeps a root id until exec would pass the ambient ones on."""
    import errno

    calls = libc.Libc()
    try:
        calls.clear_inheritable()
    except (OSError, KeyError, ValueError):
        pass  # what a command could inherit through a file's capabilities is all it keeps
    try:
        calls.prctl(libc.PR_CAP_AMBIENT, libc.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    except OSError as exc:
        return exc.errno == errno.EINVAL  # a kernel before 4.3 has no ambient capabilities
    return True


def unsettable_rlimit(name: str, value: int) -> str | None:
    """Why a command can never get ``value`` as its ``name`` rlimit (soft = hard), or None.

    Above the agent's own hard limit only a privileged process can raise it (microVM root
    can, a user namespace's root cannot), and never past the kernel's ceiling (``nofile``:
    ``fs.nr_open``). Probed on the agent itself, its limits put back: a failure in the
    command's pre-exec hook would reach the host as an anonymous error."""
    import resource

    res = getattr(resource, RLIMIT_NAMES[name])
    soft, hard = resource.getrlimit(res)
    if hard == resource.RLIM_INFINITY or value <= hard:
        return None
    try:
        resource.setrlimit(res, (soft, value))
    except (OSError, ValueError, OverflowError):
        return f"the box's hard limit is {hard}, which it cannot raise"
    resource.setrlimit(res, (soft, hard))  # privileged: it could, and it may lower again
    return None


def make_preexec(rlimits: dict[str, int], use_pty: bool) -> Any:
    """A pre-exec hook only when needed: it costs a Python-level call in the child."""
    if not rlimits and not use_pty:
        return None
    import resource

    limits = [(getattr(resource, RLIMIT_NAMES[k]), v) for k, v in rlimits.items()]

    def preexec() -> None:
        for res, value in limits:
            resource.setrlimit(res, (value, value))
        if use_pty:
            import fcntl
            import termios

            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    return preexec


def drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def send_signal(uid: int, gid: int, pid: int, pty_fd: int | None, sig: int, group: bool) -> bool:
    """Signal the process ``pid``, or its group; on a terminal the group is its foreground job,
    as Ctrl-C typed at it. False when nothing was there to signal."""
    with files.as_user(uid, gid):
        try:
            if not group:
                os.kill(pid, sig)
            else:
                os.killpg(os.tcgetpgrp(pty_fd) if pty_fd is not None else pid, sig)
        except ProcessLookupError:
            return False
        except OSError:
            os.kill(pid, sig)
    return True


def descendant_groups(pid: int) -> set[int]:
    """The process groups of ``pid``'s descendants (children, grandchildren...) as /proc
    shows them now: a child that left the command's group (``setsid``, ``setpgid``: a
    daemon, a test runner's workers) is still the command's to end. The box's pid 1 and
    the agent's own group are never among them."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(b")") + 2 :].split()  # after the name, which may hold spaces
        if len(fields) > 2:
            parents.setdefault(int(fields[1]), []).append((int(name), int(fields[2])))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child, pgid in parents.get(todo.pop(), ()):
            found.add(pgid)
            todo.append(child)
    return found - {0, 1, os.getpgid(0)}


class Termination:
    """A command being terminated: SIGTERM to its groups now, SIGKILL at ``kill_at``, done
    once no process of them is left. The groups are the command's own (it leads a session),
    on a terminal the foreground job's, and those its descendants moved to (looked up at the
    SIGTERM and again at the SIGKILL)."""

    def __init__(
        self,
        uid: int,
        gid: int,
        pid: int,
        pty_fd: int | None,
        kill_at: float,
        kill_now: bool = False,
    ) -> None:
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.groups = {pid}
        if pty_fd is not None:
            try:
                self.groups.add(os.tcgetpgrp(pty_fd))
            except OSError:
                pass
        self.groups |= descendant_groups(pid)
        self.kill_at: float | None = kill_at
        self.give_up_at: float | None = None
        if kill_now:  # no grace: SIGKILL alone, or a TERM handler would run (and could exit 0)
            self.signal_all(signal.SIGKILL)
            self.kill_at = None
            self.give_up_at = kill_at + GIVE_UP
        else:
            self.signal_all(signal.SIGTERM)

    def signal_all(self, sig: int) -> bool:
        delivered = False
        with files.as_user(self.uid, self.gid):
            for pgid in self.groups:
                try:
                    os.killpg(pgid, sig)
                    delivered = True
                except ProcessLookupError:
                    pass
                except PermissionError:
                    delivered = True  # a member the command user may not signal: it lives
        return delivered

    def step(self, now: float, reaped: bool) -> float | None:
        """KILL once the grace is over; None when done (``reaped``: the leader's status is
        known), else seconds until the next look is due."""
        if self.kill_at is not None and now >= self.kill_at:
            self.groups |= descendant_groups(self.pid)  # started in the grace
            self.signal_all(signal.SIGKILL)
            self.kill_at = None
            self.give_up_at = now + GIVE_UP
        alive = self.signal_all(0)
        if reaped and (not alive or (self.give_up_at is not None and now >= self.give_up_at)):
            return None
        if not reaped and self.kill_at is not None:
            return self.kill_at - now  # SIGCHLD wakes the loop when the leader exits
        return POLL if self.kill_at is None else min(POLL, self.kill_at - now)
