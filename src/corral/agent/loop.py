"""The guest agent's loop: one ``selectors`` loop over the channel and every child.

Stdlib only and single-threaded: the loop multiplexes the channel to the host, the pipes and
PTYs of every child, and a SIGCHLD wake-up pipe. The agent starts as the box's unprivileged
"root" (uid 0 of the box's user namespace, an unprivileged uid on the host, with only
CAP_SETUID/CAP_SETGID) and runs every command as ``uid``/``gid`` from its config, so a command
can neither signal nor inspect the agent (different uid, no ptrace: seccomp).

Every request of :mod:`protocol` is handled here (``op_<name>``), so every backend that can
start the agent gets every feature.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # not typing's: importing typing costs 0.2 s of a VM's boot under TCG

if TYPE_CHECKING:
    import os
    import signal
    import socket
    from typing import Any

    from corral.agent import commands, files, lean, protocol
else:  # inside the box there is no corral package: the siblings are found through sys.path
    # The C modules under os, signal and socket: signal's and socket's Python layers import
    # enum (lean.py); os's imports _collections_abc and posixpath, 4.4 M instructions (a
    # sixth of the agent's start to "ready"), and only commands and files need it, after.
    import _signal as signal
    import _socket as socket
    import posix as os

    import lean
    import protocol
    # commands and files are loaded after "ready": Agent.finish_start.

READ_CHUNK = 65536
BIG_PIPE = 1 << 20
"""A command's stdout or stderr pipe that a read found full is enlarged to this (the most an
unprivileged pipe takes by default) and read this much at a time: a command streaming output
costs the agent one frame per MiB, not per 64 KiB."""
F_SETPIPE_SZ = 1031
SENDFILE_MIN = 256 << 10
"""A file read of this many bytes or more goes from the page cache to the channel by
``sendfile``; smaller ones are read and sent as bytes."""
SENT = object()
"""What a request handler returns when it sent its reply itself."""
HIGH_WATER = 4 << 20  # stop reading children while this much output waits for the host
LOW_WATER = 1 << 20


class Child:
    """One process the agent started, with its output fds and exit status."""

    def __init__(self, pid: int, argv: list[str], fds: dict[int, str], stdin_fd: int | None):
        self.pid = pid
        self.argv = argv
        self.fds = fds  # fd -> stream name ("stdout", "stderr", "pty")
        self.stdin_fd = stdin_fd
        self.stdin_buf = bytearray()
        self.reads: dict[int, int] = {}
        """Output fds enlarged to BIG_PIPE -> their read size (READ_CHUNK for the rest)."""
        self.usage: tuple[float, int] | None = None
        """(CPU seconds, peak RSS bytes) from ``wait4`` once reaped."""
        self.stdin_close_after = False
        self.status: int | None = None
        self.started = time.monotonic()
        # Set by a ``terminate`` request: its exit is reported once its group is gone.
        self.ending: commands.Termination | None = None
        self.held = False
        """A ``flow`` request holds its output: its fds are not read until released."""

    @property
    def pty(self) -> int | None:
        """The terminal's master fd, if the child has one still open."""
        return next((fd for fd, name in self.fds.items() if name == "pty"), None)


class CharDevice:
    """The channel as a character device (a virtio-serial port): the few socket calls the
    loop makes, over os.read/os.write. Reading 0 bytes means the host end closed."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.fd

    def setblocking(self, flag: bool) -> None:
        os.set_blocking(self.fd, flag)

    def send(self, data: bytes | bytearray) -> int:
        return os.write(self.fd, data)

    def recv(self, size: int) -> bytes:
        return os.read(self.fd, size)

    def sendall(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]


def become_root(home: str) -> None:
    """Take box root (rootless bwrap with subordinate ids: bwrap's own id is the command
    user's, box uid 1000, and holds CAP_SETUID/CAP_SETGID only). First, as that user, make
    its home in bwrap's /home (the user's here: box root could not write it); then drop the
    host user's supplementary groups, which commands must not inherit."""
    try:
        os.lstat(home or "/")
    except OSError:
        os.mkdir(home, 0o755)
        os.chmod(home, 0o755)  # whatever the umask
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0 (rootless with one id: commands share the agent's id, so only this
    keeps them out of its /proc/PID/mem, fd and environ, which need CAP_SYS_PTRACE then)."""
    if TYPE_CHECKING:
        from corral.agent import libc
    else:
        import libc
    libc.Libc().prctl(libc.PR_SET_DUMPABLE, 0, 0, 0, 0)


class Agent:
    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("become_root"):
            become_root(str(config.get("home") or ""))
        if config.get("undumpable"):
            not_dumpable()
        self.uid = int(config.get("uid", 1000))
        self.gid = int(config.get("gid", 1000))
        self.sock: socket.socket | CharDevice
        if "device" in config:  # a virtio-serial port (microVM backend)
            self.sock = CharDevice(str(config["device"]))
        else:
            self.sock = socket.socket(fileno=int(config["fd"]))
        if "seccomp" in config:  # microVM, gVisor: the host's filter, before any thread starts
            if TYPE_CHECKING:
                from corral.agent import seccomp
            else:
                import seccomp
            seccomp.install(str(config["seccomp"]))
        # Variables the backend gives every command (a command's own env overrides them).
        self.base_env = {str(k): str(v) for k, v in dict(config.get("env") or {}).items()}
        self.sock.setblocking(False)
        self.sel = lean.Poller()
        self.decoder = protocol.FrameDecoder()
        self.outbuf = bytearray()
        self.outfile: list[int] = []  # [fd, offset, bytes left]: a payload sendfile sends
        self.later = bytearray()  # frames sent while ``outfile`` is in flight, after it
        self.children: dict[int, Child] = {}
        self.ending: list[Child] = []  # children being terminated (``op_terminate``)
        self.fd_owner: dict[int, Child] = {}
        self.paused = False
        self.running = True
        self.files: files.FileOps
        self.inherited_rlimits: dict[str, int] = {}
        self.home = str(config.get("home") or "")
        self.info_extra = dict(config.get("info", {}))
        self.cgroup = str(config.get("cgroup") or "")
        self.landlock_rules = dict(config.get("landlock") or {"off": "not asked for"})
        self.landlock: dict[str, Any] | None = None  # what info() reports, once applied
        if config.get("forwarders") or config.get("vmlink") or config.get("publishers"):
            if TYPE_CHECKING:
                from corral.agent import relays
            else:
                import relays
            relays.start(config)
        # The host sends the default open-file cap (``backends.limits.agent_rlimits``).
        self.start_rlimits = {str(k): int(v) for k, v in dict(config.get("rlimits") or {}).items()}
        self.start_refusal: AgentError | None = None
        """Why no command can run here (a start rlimit the box could not take), or None."""
        rd, wr = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wake_r = rd
        signal.set_wakeup_fd(wr)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # A signal the host process ignored (SIGHUP under nohup; SIGINT and SIGQUIT for a
        # shell's `cmd &`) stays ignored across fork and exec, so every command would ignore
        # it too: a shell would survive its hang-up, Ctrl-C would not stop a job. A handler
        # is reset to the default on exec: commands start with the default action, and the
        # agent still ignores them.
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        self.sel.register(self.sock, lean.EVENT_READ, "chan")
        self.chan_events = lean.EVENT_READ
        self.sel.register(rd, lean.EVENT_READ, "wake")

    # ---- channel -------------------------------------------------------------------------
    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        # Header and payload appended apart: a large payload (a file read) is copied once
        # into the buffer, not once more into a whole frame first.
        out = self.later if self.outfile else self.outbuf
        out += protocol.encode_head(header, len(payload))
        if payload:
            out += payload
        self.flush()

    def send_file(self, header: dict[str, Any], fd: int, offset: int, count: int) -> None:
        """A frame whose payload is ``count`` bytes of the regular file ``fd`` from
        ``offset``, which the kernel sends from the page cache (sendfile): the agent never
        holds them. Takes ``fd`` (closed once sent). Only on a socket, with nothing else in
        flight; otherwise read and sent as bytes."""
        if self.outfile or not isinstance(self.sock, socket.socket):
            try:
                data = os.pread(fd, count, offset)
            finally:
                os.close(fd)
            self.send(header, data + bytes(count - len(data)))  # the length is promised
            return
        self.outbuf += protocol.encode_head(header, count)
        self.outfile = [fd, offset, count]
        self.flush()

    def flush(self) -> None:
        while self.outbuf or self.outfile:
            try:
                if self.outbuf:
                    n = self.sock.send(self.outbuf)
                    del self.outbuf[:n]
                    continue
                fd, offset, left = self.outfile
                n = os.sendfile(self.sock.fileno(), fd, offset, left)
            except BlockingIOError:
                break
            except OSError:
                # The host is gone: nothing left to serve.
                self.running = False
                return
            if n == 0:  # the file shrank meanwhile: the frame still carries its length
                self.outbuf += bytes(left)
                n = left
            self.outfile[1:] = [offset + n, left - n]
            if n == left:
                os.close(fd)
                self.outfile = []
                self.outbuf += self.later
                self.later = bytearray()
        pending = self.outbuf or self.outfile
        events = lean.EVENT_READ | (lean.EVENT_WRITE if pending else 0)
        if events != self.chan_events:  # an epoll_ctl per frame otherwise
            self.sel.modify(self.sock, events, "chan")
            self.chan_events = events
        self.apply_backpressure()

    def apply_backpressure(self) -> None:
        if not self.paused and len(self.outbuf) + len(self.later) > HIGH_WATER:
            watched = [fd for fd in self.fd_owner if self.watched(fd)]
            self.paused = True
            for fd in watched:
                self.sel.unregister(fd)
        elif self.paused and len(self.outbuf) + len(self.later) < LOW_WATER:
            self.paused = False
            for fd in self.fd_owner:
                if self.watched(fd):
                    self.sel.register(fd, lean.EVENT_READ, "out")

    def watched(self, fd: int) -> bool:
        """Whether the output fd ``fd`` is in the selector: not while the channel is backed
        up (all of them), nor while its process is held (``flow``)."""
        return not self.paused and not self.fd_owner[fd].held

    def on_channel(self, mask: int) -> None:
        if mask & lean.EVENT_WRITE:
            self.flush()
        if not mask & lean.EVENT_READ:
            return
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.running = False
            return
        for header, payload in self.decoder.feed(data):
            self.dispatch(header, payload)

    def dispatch(self, header: dict[str, Any], payload: bytes) -> None:
        req_id = header.get("id")
        try:
            op = protocol.check_request(header)
            if self.landlock is None and op not in ("ping", "shutdown"):
                self.apply_landlock()
            result = getattr(self, "op_" + op)(header, payload)
            if result is SENT:
                return
            reply, data = result if isinstance(result, tuple) else (result, b"")
            self.send({"re": req_id, **reply}, data)
        except protocol.FrameError as exc:
            self.send_error(req_id, protocol.ErrorCode.PROTOCOL_ERROR, str(exc))
        except (AgentError, files.FileOpFailed) as exc:
            self.send_error(req_id, exc.code, exc.message)
        except Exception as exc:  # the agent must survive any request
            self.send_error(req_id, protocol.ErrorCode.AGENT_ERROR, repr(exc))

    def send_error(self, req_id: object, code: str, message: str) -> None:
        self.send({"re": req_id, "error": {"code": code, "message": message}})

    # ---- processes -----------------------------------------------------------------------
    def check_rlimits(self, wanted: dict[str, int]) -> None:
        """Refuse, naming it, an rlimit no command can get (before the fork: a failure in
        the child's pre-exec hook reaches the host as an anonymous error)."""
        for name, value in wanted.items():  # inherited soft = hard: a command cannot raise it
            cap = self.inherited_rlimits.get(name)
            if cap is not None and value > cap:
                raise AgentError(
                    protocol.ErrorCode.INVALID_INPUT,
                    f"rlimits.{name}: {value} is above this box's limit ({cap}), which no "
                    "command can raise; a call may only lower it",
                )
        for name, value in wanted.items():
            hard = commands.unsettable_rlimit(name, value)
            if hard is not None:
                raise AgentError(
                    protocol.ErrorCode.INVALID_INPUT,
                    f"rlimits.{name} (the policy's limits.rlimits.{name}, or the call's): "
                    f"{value} is above what this box can set ({hard})",
                )
        if self.start_refusal is not None:  # a start limit of the box's own it lacks
            raise self.start_refusal

    def op_spawn(self, h: protocol.SpawnRequest, payload: bytes) -> protocol.SpawnReply:
        argv = [str(a) for a in h["argv"]]
        env = {**self.base_env, **{str(k): str(v) for k, v in dict(h.get("env") or {}).items()}}
        cwd = h.get("cwd") or None
        stdin_mode = h.get("stdin", "null")  # "null" | "data" | "pipe"
        rlimits = {str(k): int(v) for k, v in dict(h.get("rlimits") or {}).items()}
        use_pty = bool(h.get("pty"))
        master = slave = -1
        if use_pty:
            master, slave = os.openpty()
            commands.set_winsize(slave, int(h.get("rows", 24)), int(h.get("cols", 80)))
            stdio = (slave, slave, slave)
        else:
            stdin = commands.DEVNULL if stdin_mode == "null" else commands.PIPE
            stdio = (stdin, commands.PIPE, commands.PIPE)
        wanted = {k: v for k, v in rlimits.items() if self.inherited_rlimits.get(k) != v}
        self.check_rlimits(wanted)
        preexec = commands.make_preexec(wanted, use_pty)
        # The child changes directory before it drops to the command user, and the agent
        # has no DAC override: take the user's effective ids for the fork so the cwd is
        # checked as the command sees it (setreuid then drops the saved root id too).
        # CPython forks the agent for this (it never vforks a child that changes ids); a
        # vfork from the user's own real ids was faster but let a running command signal
        # the agent in the moment between the exec and the agent taking its ids back.
        try:
            with files.as_user(self.uid, self.gid):
                try:
                    proc = commands.start(
                        argv,
                        cwd=cwd,
                        env=env,
                        uid=self.uid,
                        gid=self.gid,
                        new_session=not use_pty,
                        preexec=preexec,
                        stdin=stdio[0],
                        stdout=stdio[1],
                        stderr=stdio[2],
                    )
                except OSError as exc:  # explained as the command user sees it
                    path = env.get("PATH", "")
                    code, message = commands.spawn_error(exc, argv[0], cwd, path)
                    raise AgentError(code, message) from None
        except BaseException:
            if use_pty:
                os.close(master)
            raise
        finally:
            if use_pty:
                os.close(slave)
        if use_pty:
            fds = {master: "pty"}
            stdin_fd: int | None = master
        else:
            assert proc.stdout is not None and proc.stderr is not None
            fds = {proc.stdout: "stdout", proc.stderr: "stderr"}
            stdin_fd = proc.stdin
        child = Child(proc.pid, argv, fds, stdin_fd)
        for fd in fds:
            os.set_blocking(fd, False)
            self.fd_owner[fd] = child
            if self.watched(fd):
                self.sel.register(fd, lean.EVENT_READ, "out")
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)
        self.children[proc.pid] = child
        if stdin_mode == "data" and not use_pty:
            child.stdin_buf += payload
            child.stdin_close_after = True
            self.pump_stdin(child)
        elif payload:
            child.stdin_buf += payload
            self.pump_stdin(child)
        return {"pid": proc.pid}

    def op_write(self, h: protocol.WriteRequest, payload: bytes) -> protocol.Done:
        child = self.child(h["pid"])
        if child.stdin_fd is None:
            message = f"process {child.pid} has no open stdin"
            raise AgentError(protocol.ErrorCode.INVALID_INPUT, message)
        child.stdin_buf += payload
        if h.get("eof"):
            child.stdin_close_after = True
        self.pump_stdin(child)
        return {"ok": True}

    def op_flow(self, h: protocol.FlowRequest, payload: bytes) -> protocol.Done:
        child = self.children.get(h["pid"])
        if child is None or child.pty is not None or child.held == h["hold"]:
            return {"ok": True}  # gone (its exit is on its way), on a terminal, or as asked
        was = {fd: self.watched(fd) for fd in child.fds}
        child.held = h["hold"]
        for fd, watched in was.items():
            if watched and not self.watched(fd):
                self.sel.unregister(fd)
            elif not watched and self.watched(fd):
                self.sel.register(fd, lean.EVENT_READ, "out")
        return {"ok": True}

    def op_close_stdin(self, h: protocol.CloseStdinRequest, payload: bytes) -> protocol.Done:
        child = self.child(h["pid"])
        child.stdin_close_after = True
        self.pump_stdin(child)
        return {"ok": True}

    def pump_stdin(self, child: Child) -> None:
        fd = child.stdin_fd
        if fd is None:
            return
        try:
            while child.stdin_buf:
                n = os.write(fd, child.stdin_buf)
                del child.stdin_buf[:n]
        except BlockingIOError:
            pass
        except OSError:
            child.stdin_buf.clear()  # reader gone (EPIPE): nothing more to deliver
        writing = bool(child.stdin_buf)
        is_pty = fd in child.fds
        if is_pty:
            events = lean.EVENT_READ | (lean.EVENT_WRITE if writing else 0)
            if fd in self.fd_owner and not self.paused:
                self.sel.modify(fd, events, "out")
            return
        registered = self.sel.get_map().get(fd) is not None
        if writing and not registered:
            self.sel.register(fd, lean.EVENT_WRITE, "stdin")
        elif not writing and registered:
            self.sel.unregister(fd)
        if not writing and child.stdin_close_after:
            os.close(fd)
            child.stdin_fd = None

    def op_signal(self, h: protocol.SignalRequest, payload: bytes) -> protocol.SignalReply:
        child = self.child(h["pid"])
        group = h.get("group", True)
        sent = commands.send_signal(self.uid, self.gid, child.pid, child.pty, h["signal"], group)
        return {"delivered": sent}

    def op_terminate(self, h: protocol.TerminateRequest, payload: bytes) -> protocol.TerminateReply:
        """SIGTERM to the group now, SIGKILL at the end of the grace (at once, alone, with
        none); the exit is reported once nothing of the group is left (:meth:`tick`)."""
        child = self.child(h["pid"])
        if child.ending is not None:
            return {"delivered": True}  # already ending: its deadline stands
        grace = max(0.0, h["grace"])
        kill_at = time.monotonic() + grace
        child.ending = commands.Termination(
            self.uid, self.gid, child.pid, child.pty, kill_at, kill_now=grace == 0
        )
        self.ending.append(child)
        return {"delivered": child.status is None}

    def tick(self) -> float | None:
        """Move every ending child along (KILL at its deadline, report it once its groups are
        gone); seconds until the next look is due, None when no child is ending."""
        if not self.ending:
            return None
        now = time.monotonic()
        wait: float | None = None
        for child in list(self.ending):
            assert child.ending is not None
            due = child.ending.step(now, reaped=child.status is not None)
            if due is None:
                self.ending.remove(child)
                child.ending = None
                self.maybe_finish(child)
            else:
                wait = due if wait is None else min(wait, due)
        return wait

    def op_resize(self, h: protocol.ResizeRequest, payload: bytes) -> protocol.Done:
        child = self.child(h["pid"])
        for fd, name in child.fds.items():
            if name == "pty":
                commands.set_winsize(fd, h["rows"], h["cols"])
                return {"ok": True}
        raise AgentError(protocol.ErrorCode.INVALID_INPUT, f"process {child.pid} has no terminal")

    def op_stats(self, h: protocol.StatsRequest, payload: bytes) -> protocol.StatsReply:
        child = self.child(h["pid"])
        if TYPE_CHECKING:
            from corral.agent import info
        else:
            import info
        return info.process_group_stats(child.pid, child.status is not None)

    def child(self, pid: int) -> Child:
        child = self.children.get(pid)
        if child is None:
            raise AgentError(protocol.ErrorCode.PROCESS_NOT_FOUND, f"no process with pid {pid}")
        return child

    def on_output(self, fd: int, mask: int) -> None:
        child = self.fd_owner[fd]
        if mask & lean.EVENT_WRITE:
            self.pump_stdin(child)
        if mask & lean.EVENT_READ:
            self.read_output(child, fd, drain=False)

    def read_output(self, child: Child, fd: int, drain: bool) -> None:
        while True:
            size = child.reads.get(fd, READ_CHUNK)
            try:
                data = os.read(fd, size)
            except BlockingIOError:
                return
            except OSError:  # EIO from a PTY whose last writer is gone
                data = b""
            if not data:
                self.close_output(child, fd)
                return
            self.send({"ev": "out", "pid": child.pid, "stream": child.fds[fd]}, data)
            if len(data) == READ_CHUNK and fd not in child.reads and child.fds[fd] != "pty":
                child.reads[fd] = self.enlarge(fd)
            if not drain:
                return

    @staticmethod
    def enlarge(fd: int) -> int:
        """Make the pipe ``fd`` BIG_PIPE if the kernel lets this user (pipe-max-size,
        pipe-user-pages-soft); the read size that suits it."""
        import fcntl

        try:
            fcntl.fcntl(fd, F_SETPIPE_SZ, BIG_PIPE)
        except OSError:
            return READ_CHUNK
        return BIG_PIPE

    def close_output(self, child: Child, fd: int) -> None:
        if fd not in self.fd_owner:
            return
        if self.watched(fd):
            self.sel.unregister(fd)
        del self.fd_owner[fd]
        if fd == child.stdin_fd:
            child.stdin_fd = None
        os.close(fd)
        del child.fds[fd]
        self.maybe_finish(child)

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.get(pid)
            if child is None:
                continue  # an orphan we adopted: reaped, nothing to report
            child.status = status
            # Its final figures (reaped descendants included), for stats after the exit.
            child.usage = (usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)
            # What the process wrote before exiting is already in the pipe: deliver it, then
            # stop listening, so a daemonised grandchild holding the pipe cannot stall the exit.
            for fd in list(child.fds):
                self.read_output(child, fd, drain=True)
                self.close_output(child, fd)
            self.maybe_finish(child)

    def maybe_finish(self, child: Child) -> None:
        if child.status is None or child.fds or child.ending is not None:
            return
        if child.stdin_fd is not None and child.stdin_fd not in child.fds:
            if self.sel.get_map().get(child.stdin_fd) is not None:  # input it never took
                self.sel.unregister(child.stdin_fd)
            try:
                os.close(child.stdin_fd)
            except OSError:
                pass
            child.stdin_fd = None
        if child.pid not in self.children:
            return
        del self.children[child.pid]
        status = child.status
        code = os.waitstatus_to_exitcode(status)
        msg: protocol.ExitEvent = {"ev": "exit", "pid": child.pid, "exit_code": code}
        if code < 0:
            msg["signal"] = -code
        msg["duration"] = time.monotonic() - child.started
        if child.usage is not None:
            msg["cpu_seconds"], msg["max_rss_bytes"] = child.usage
        if self.cgroup:  # a microVM: the host sees no cgroup of the box, so it gets the counts
            if TYPE_CHECKING:
                from corral.agent import info
            else:
                import info
            msg["box"] = info.cgroup_counters(self.cgroup)
        self.send(dict(msg))

    # ---- information and files -----------------------------------------------------------
    def op_ping(self, h: protocol.PingRequest, payload: bytes) -> protocol.PingReply:
        return {}  # the host's heartbeat: answering at all is the point

    def op_info(self, h: protocol.InfoRequest, payload: bytes) -> protocol.InfoReply:
        if TYPE_CHECKING:
            from corral.agent import info
        else:
            import info
        reply = info.collect_info(self.info_extra)
        reply["landlock"] = dict(self.landlock or {})
        return reply

    def op_file_read(
        self, h: protocol.FileReadRequest, payload: bytes
    ) -> tuple[protocol.FileReadReply, bytes] | object:
        idle = isinstance(self.sock, socket.socket) and not self.outfile
        cap = protocol.MAX_PAYLOAD if idle else files.MAX_READ
        reply, fd, count = self.files.open_read(h, cap)
        offset = h.get("offset", 0)
        if idle and reply["size"] > 0 and count >= SENDFILE_MIN:
            self.send_file({"re": h["id"], **reply}, fd, offset, count)
            return SENT
        count = min(count, files.MAX_READ)  # /proc or /sys (size 0): no more than ever
        return reply, files.read_open(fd, offset, count)

    def op_file_write(
        self, h: protocol.FileWriteRequest, payload: bytes
    ) -> protocol.FileWriteReply:
        return self.files.write(h, payload)

    def op_file_list(self, h: protocol.FileListRequest, payload: bytes) -> protocol.FileListReply:
        return self.files.list(h)

    def op_file_stat(self, h: protocol.FileStatRequest, payload: bytes) -> protocol.FileStatReply:
        return self.files.stat(h)

    def op_file_mkdir(self, h: protocol.FileMkdirRequest, payload: bytes) -> protocol.Done:
        return self.files.mkdir(h)

    def op_file_remove(self, h: protocol.FileRemoveRequest, payload: bytes) -> protocol.Done:
        return self.files.remove(h)

    def op_publish(self, h: protocol.PublishRequest, payload: bytes) -> protocol.Done:
        """Publish one more box port after the start (``Sandbox.expose``): the host socket
        already listens in the network directory; dial it as for the start's publishers."""
        if TYPE_CHECKING:
            from corral.agent import relays
        else:
            import relays
        relays.start_publishers([{"port": int(h["port"]), "unix": str(h["unix"])}])
        return {}

    def op_shutdown(self, h: protocol.ShutdownRequest, payload: bytes) -> protocol.Done:
        with files.as_user(self.uid, self.gid):
            try:
                os.kill(-1, signal.SIGKILL)  # every process of the command user in the box
            except OSError:
                pass
        self.running = False
        return {"ok": True}

    # ---- loop ----------------------------------------------------------------------------
    def finish_start(self) -> None:
        """What requests need but "ready" does not, done right after it and before the first
        request is read: the host is still setting up meanwhile, and no request is served
        without it. (The agent never imports ``subprocess``: see :func:`commands.start`.)"""
        global commands, files
        if not TYPE_CHECKING:
            import commands
            import files

        self.files = files.FileOps(self.uid, self.gid)
        if self.home:  # before any command: the user's home where the backend did not make it
            files.make_home(self.home, self.uid, self.gid)
        # Limits every command gets anyway are set once on the agent and inherited, so the
        # common spawn needs no Python pre-exec hook in the child (about 0.8 ms a command).
        self.inherited_rlimits = commands.set_inherited_rlimits(
            {**self.start_rlimits, "core": 0, "msgqueue": commands.BOX_MSGQUEUE_BYTES}
        )
        # A limit of the policy's that the box could not take (above a hard limit it cannot
        # raise: a user namespace's root) would leave commands under the host's own limit
        # while info() reports the policy's: every command is refused, naming it, instead.
        for name, value in self.start_rlimits.items():
            if name not in self.inherited_rlimits:
                why = commands.unsettable_rlimit(name, value) or "setrlimit refused it"
                self.start_refusal = AgentError(
                    protocol.ErrorCode.INVALID_INPUT,
                    f"rlimits.{name}: the box could not take {value} ({why}): lower the "
                    f"policy's limits.rlimits.{name} (where no cgroup enforces them, as "
                    "rootless, limits.max_pids is RLIMIT_NPROC and limits.memory_bytes "
                    "RLIMIT_AS)",
                )
                break
        # No capability a command could inherit through its exec (ambient, inheritable).
        commands.shed_exec_capabilities()
        # Last, and before the first request: the agent and every command it starts from
        # now on stay within the box's Landlock rules (landlock.py). A warm pool's box
        # waits for the first request after its workspace is mounted (``deferred``).
        if not self.landlock_rules.get("deferred"):
            try:
                self.apply_landlock()
            except AgentError:
                pass  # every request but ping and shutdown says why (dispatch)

    def apply_landlock(self) -> None:
        """Restrict the agent (and so every command it starts later) once; AgentError, and
        no request served, when a kernel that has Landlock refuses the rules."""
        if TYPE_CHECKING:
            from corral.agent import landlock
        else:
            import landlock
        try:
            self.landlock = landlock.apply(
                self.landlock_rules, lambda: files.as_user(self.uid, self.gid)
            )
        except OSError as exc:
            message = f"Landlock could not be applied: {exc} (security.landlock = false skips it)"
            raise AgentError(protocol.ErrorCode.AGENT_ERROR, message) from None

    def run(self) -> None:
        self.send({"ev": "ready", "pid": os.getpid()})
        self.finish_start()
        wait: float | None = None
        while self.running:
            for key, mask in self.sel.select(wait):
                if key.data == "chan":
                    self.on_channel(mask)
                elif key.data == "wake":
                    commands.drain_fd(self.wake_r)
                    self.reap()
                elif key.data == "stdin":
                    # An earlier event of this batch may have closed it (its child's stdin
                    # ended, the child exited): nobody owns it any more, nothing to pump.
                    owner = self.stdin_owner(int(key.fd))
                    if owner is not None:
                        self.pump_stdin(owner)
                elif int(key.fd) in self.fd_owner:
                    self.on_output(int(key.fd), mask)
            wait = self.tick()
        self.sock.setblocking(True)
        try:
            self.flush()  # blocking now: whatever is queued, a file in flight included
        except OSError:
            pass

    def stdin_owner(self, fd: int) -> Child | None:
        return next((c for c in self.children.values() if c.stdin_fd == fd), None)


class AgentError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def serve(config: dict[str, Any]) -> None:
    """Serve the host until it closes the channel or asks for a shutdown, then exit."""
    agent = Agent(config)
    try:
        agent.run()
    except (BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass
    os._exit(0)
