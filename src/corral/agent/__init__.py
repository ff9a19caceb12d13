"""The guest agent: the only corral code that runs inside a box (stdlib only).

Inside a box there is no ``corral`` package: the backend starts ``python3 -I -S agent.py``
with this directory on ``sys.path``, and the modules import each other as top-level siblings.
The host imports the shared parts (:mod:`protocol`, :mod:`vmlink`) as ``corral.agent.*``.
Start with :mod:`protocol` (what the host may ask, what the agent answers), then :mod:`loop`.

=============  ===========================================================================
module         concern
=============  ===========================================================================
agent.py       the entry point: read the config (or be a microVM's PID 1), run the loop
protocol.py    every message and error code of the channel, frames, validation (host too)
loop.py        the select loop: the channel, requests, children's pipes and PTYs, reaping
commands.py    starting a command (rlimits, PTY, spawn errors) and ending one (TERM, KILL)
files.py       file operations confined beneath a root with openat2
info.py        what the box reports: kernel and memory, a process group's use, cgroup counts
relays.py      loopback listeners relaying to host unix sockets (egress proxy, ports)
vmlink.py      a microVM's network link: connections multiplexed over a port device
vminit.py      a microVM's PID 1: preload, snapshot point, mounts, switch root, clock
seccomp.py     install the host's compiled seccomp filter on the agent (microVM, gVisor)
landlock.py    Landlock rules on the agent, inherited by every command
libc.py        syscall and prctl through _ctypes alone (Landlock, capabilities, dumpable)
lean.py        json and a poller from the C modules alone (a faster start)
=============  ===========================================================================
"""
