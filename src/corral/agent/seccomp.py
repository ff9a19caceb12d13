"""Installing the host's compiled seccomp filter on the agent itself (the microVM backend;
the other backends apply the same filter from the host as they start the box)."""

from __future__ import annotations


def install(path: str) -> None:
    """Install a compiled seccomp filter (cBPF, as the host built it) on the agent itself,
    with no_new_privs: every command inherits it. Failing to is fatal: no box without it."""
    import ctypes

    with open(path, "rb") as f:
        program = f.read()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
