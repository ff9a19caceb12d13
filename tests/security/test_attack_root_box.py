"""A box whose commands are box root (``policy.user = "root"``, with ROOT_CAPS) trying to
leave a privileged file for the host or the next box: setuid or setgid bits by every call
that sets a mode (chmod, fchmod, fchmodat, fchmodat2, creating opens, mknod, a tar
extracted with ``-p``, ``cp -p`` of the host's own setuid binaries), and file capabilities
(``security.capability``). None may survive in the workspace."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, Sandbox
from corral.errors import BackendUnavailable
from security.helpers import box_py

pytestmark = [pytest.mark.attack("privilege"), pytest.mark.needs_bwrap]

ATTEMPTS = """
import ctypes, io, os, shutil, stat, struct, subprocess, tarfile
res = {}
shutil.copy('/bin/true', '/workspace/t')
res['chmod'] = err(os.chmod, '/workspace/t', 0o4755)
res['chmod_setgid'] = err(os.chmod, '/workspace/t', 0o2755)
libc = ctypes.CDLL(None, use_errno=True)
def fchmodat2():
    if libc.syscall(452, -100, b'/workspace/t', 0o4755, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
res['fchmodat2'] = err(fchmodat2)
res['create'] = err(lambda: os.close(os.open('/workspace/c', os.O_WRONLY | os.O_CREAT, 0o6755)))
res['mknod'] = err(os.mknod, '/workspace/n', stat.S_IFREG | 0o4755)
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode='w') as tar:
    data = open('/bin/true', 'rb').read()
    info = tarfile.TarInfo('tarred'); info.size = len(data); info.mode = 0o4755
    tar.addfile(info, io.BytesIO(data))
open('/tmp/s.tar', 'wb').write(buf.getvalue())
res['tar'] = subprocess.run(['tar', '-xpf', '/tmp/s.tar', '-C', '/workspace'],
                            capture_output=True).returncode
setuid = [p for p in ('/usr/bin/passwd', '/usr/bin/su', '/bin/mount') if os.path.exists(p)
          and os.stat(p).st_mode & stat.S_ISUID]
res['host_setuid'] = setuid[:1]
for p in setuid[:1]:
    res['cp_p'] = subprocess.run(['cp', '-p', p, '/workspace/copied'],
                                 capture_output=True).returncode
# file capabilities: VFS_CAP_REVISION_2 with CAP_SETUID (7) permitted and effective
blob = struct.pack('<IIIII', 0x02000001, 1 << 7, 0, 0, 0)
res['fcaps'] = err(os.setxattr, '/workspace/t', 'security.capability', blob)
res['id'] = os.getuid()
"""


async def as_box_root(box_policy: Policy, workspace: Path, code: str) -> Any:
    """``code``'s ``res`` from a box whose commands are box root (skipped where the backend
    has no root box); the box is closed before this returns."""
    try:
        sb = Sandbox(box_policy.model_copy(update={"user": "root"}), workspace=workspace)
        await sb.start()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    try:
        return await box_py(sb, code)
    finally:
        await sb.aclose()


async def test_a_root_box_leaves_no_setuid_file_and_no_file_capability(
    box_policy: Policy, workspace: Path
) -> None:
    res = await as_box_root(box_policy, workspace, ATTEMPTS)
    assert res["id"] == 0, res  # the attack ran as box root
    assert res["chmod"] and res["chmod_setgid"] and res["fchmodat2"], res
    assert res["create"] and res["mknod"], res
    left = []
    for path in workspace.rglob("*"):
        st = path.lstat()
        if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            left.append(f"{path.name}: {stat.filemode(st.st_mode)}")
        try:
            os.getxattr(path, "security.capability", follow_symlinks=False)
            left.append(f"{path.name}: file capabilities")
        except OSError:
            pass
    assert left == [], (left, res)


AGENT_FDS = """
pid = agent_pid()
fds = os.listdir(f'/proc/{pid}/fd') if not err(os.listdir, f'/proc/{pid}/fd') else []
res = {
    'pid': pid,
    'listed': len(fds),
    'open': [err(os.open, f'/proc/{pid}/fd/{fd}', os.O_RDONLY) for fd in fds],
    'readlink': [err(os.readlink, f'/proc/{pid}/fd/{fd}') for fd in fds],
    'environ': err(lambda: open(f'/proc/{pid}/environ', 'rb').read()),
    'mem': err(lambda: open(f'/proc/{pid}/mem', 'rb').read(1)),
    'getfd': [sc(438, sc(434, pid, 0)['ret'], fd, 0)['errno'] for fd in (3, 4, 5)],
}
"""


async def test_box_root_sees_at_most_the_agents_fd_numbers(
    box_policy: Policy, workspace: Path
) -> None:
    """Box root and the agent share an id, so box root may list the numbers of the agent's
    open fds (the agent is not dumpable: its /proc entries are box root's). Opening one,
    reading where it points, its environment or memory, or taking it with pidfd_getfd needs
    CAP_SYS_PTRACE, which box root does not hold."""
    res = await as_box_root(box_policy, workspace, AGENT_FDS)
    assert res["pid"] > 0, res
    if box_policy.runtime == "runsc":
        pytest.skip(
            f"gVisor skips the ptrace check on /proc/<pid>/fd (see test_attack_privilege): {res}"
        )
    denied = {"EACCES", "EPERM"}
    assert set(res["open"]) <= denied and set(res["readlink"]) <= denied, res
    assert res["environ"] in denied and res["mem"] in denied, res
    assert all(e is not None for e in res["getfd"]), res
