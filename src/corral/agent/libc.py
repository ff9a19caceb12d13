"""``syscall`` and ``prctl`` of the C library for the guest agent, through ``_ctypes`` alone.

``_ctypes`` costs 0.8 ms to import, ``ctypes`` itself 4 ms or more. The calls here take
integers and byte strings, which ``_ctypes`` passes as ``long`` and ``char *``: nothing
needs ``ctypes``' Python layer.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the guest agent does not import typing (see loop.py)
if TYPE_CHECKING:
    from typing import Any

PR_SET_DUMPABLE = 4
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAPABILITY_VERSION_3 = 0x20080522


class Libc:
    """``syscall`` and ``prctl`` of the C library, through ``_ctypes`` alone."""

    def __init__(self) -> None:
        import _ctypes

        simple: Any = _ctypes._SimpleCData  # generic to the type checker, not at run time

        class Long(simple):  # type: ignore[misc]
            _type_ = "l"

        class Func(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = Long

        handle = _ctypes.dlopen(None, _ctypes.RTLD_GLOBAL)  # type: ignore[arg-type]
        self._syscall = Func(_ctypes.dlsym(handle, "syscall"))
        self._prctl = Func(_ctypes.dlsym(handle, "prctl"))
        self._capset = Func(_ctypes.dlsym(handle, "capset"))
        self._long = Long
        self._errno = _ctypes.get_errno
        self._set_errno = _ctypes.set_errno

    def _args(self, args: tuple[int | bytes | None, ...]) -> list[Any]:
        return [self._long(a) if isinstance(a, int) else a for a in args]

    def syscall(self, name: str, *args: int | bytes | None) -> int:
        self._set_errno(0)
        result = int(self._syscall(*self._args(args)))
        if result < 0:
            err = self._errno()
            raise OSError(err, f"{name}: {os.strerror(err)}")
        return result

    def prctl(self, *args: int) -> None:
        if int(self._prctl(*self._args(args))) != 0:
            err = self._errno()
            raise OSError(err, f"prctl: {os.strerror(err)}")

    def clear_inheritable(self) -> None:
        """``capset``: keep the effective and permitted sets, empty the inheritable one."""
        with open("/proc/self/status", "rb") as f:
            status = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        eff, prm = int(status[b"CapEff"], 16), int(status[b"CapPrm"], 16)
        header = CAPABILITY_VERSION_3.to_bytes(4, "little") + bytes(4)  # this process
        data = b"".join(
            (eff >> shift & 0xFFFFFFFF).to_bytes(4, "little")
            + (prm >> shift & 0xFFFFFFFF).to_bytes(4, "little")
            + bytes(4)
            for shift in (0, 32)
        )
        if int(self._capset(header, data)) != 0:
            err = self._errno()
            raise OSError(err, f"capset: {os.strerror(err)}")
