"""Host-side helpers every backend shares: cgroups, seccomp filters, idmapped mounts, mount
syscalls and the one mountinfo parser, staging directories, per-box state and the orphan
sweeps' bookkeeping, the interpreter that runs the guest agent, the host threads blocking
work runs in and the host-side child (bwrap, a jailed qemu) started from one. Nothing here
knows a backend.
"""
