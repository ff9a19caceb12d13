"""Host-side helpers every backend shares: cgroups, seccomp filters, idmapped mounts, mount
syscalls and the one mountinfo parser, staging directories, per-box state and the orphan
sweeps' bookkeeping, the interpreter that runs the guest agent. Nothing here knows a backend.
"""
