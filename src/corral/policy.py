"""What a sandbox may do: filesystem, network, limits, security preset, environment.

A :class:`Policy` is immutable and validated on construction (pydantic, ``extra="forbid"``),
so a typo in a policy file is an error naming the field, never a silently ignored key. It
mirrors the spec's ``SandboxConfig``. Sizes accept integers (bytes) or strings such as
``"512M"`` or ``"2GiB"``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import posixpath
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from corral import specconfig
from corral.bounds import CPU_PERIOD_US as CPU_PERIOD_US
from corral.bounds import MAX_CPU_QUOTA as MAX_CPU_QUOTA
from corral.bounds import MAX_PIDS, MAX_RLIMIT, check_size
from corral.bounds import MIN_CPU_QUOTA as MIN_CPU_QUOTA
from corral.bounds import MIN_MEMORY_BYTES as MIN_MEMORY_BYTES
from corral.bounds import MIN_PIDS as MIN_PIDS
from corral.bounds import parse_size as parse_size
from corral.errors import PolicyError

Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0), AfterValidator(check_size)]

VM_GUEST_MEMORY_MB = 128
"""What a microVM's own kernel, initramfs and guest agent take of its RAM beside the box's
memory limit, plus 1/8 of the limit (the kernel's page tables and structures grow with the
RAM). Measured in the guest: a 192 MiB VM leaves 92 MiB available, a 1152 MiB one 950 MiB.
See :func:`vm_room`."""
VM_DEFAULT_MEMORY_MB = 512
"""VM RAM when the box has no memory limit and ``vm.memory_mb`` is not given."""
VM_MEMORY_STEP_MB = 64
"""Derived VM RAM is rounded up to this step, so nearby limits share one saved VM."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


RlimitName = Literal["nofile", "fsize", "core", "nproc", "as", "cpu", "stack", "data", "memlock"]

# Paths masked by default: the usual places for credentials. "~" is the home of the user
# running corral, expanded when the sandbox starts.
DEFAULT_DENY_READ: tuple[str, ...] = (
    "~/.ssh",
    "~/.aws",
    "~/.config/gcloud",
    "~/.azure",
    "~/.kube",
    "~/.docker",
    "~/.gnupg",
    "~/.netrc",
    "~/.git-credentials",
    "~/.npmrc",
    "~/.pypirc",
    "/root",
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
    "/etc/ssh",
    "/etc/sudoers",
    "/etc/sudoers.d",
)


MIN_ROOT_SIZE = 1 << 20
"""Smallest ``filesystem.root_size`` (a writable image root's tmpfs)."""
DEFAULT_WORKDIR = "/workspace"
"""Where the workspace appears in a box unless the policy says otherwise."""


def _no_core_dumps() -> dict[RlimitName, int]:
    return {"core": 0}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        """Validate; a bad field is a :class:`PolicyError` naming it, never pydantic's raw
        ``ValidationError``."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise PolicyError(_describe(exc)) from None

    # Nested models are validated by pydantic directly, as with BaseModel's own __init__
    # (pydantic's RootModel marks its __init__ the same way); only the outer call converts.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


def _one_or_many(value: object) -> object:
    """A single string where a list is expected (``deny_read = "~/.ssh"``) is one entry."""
    if isinstance(value, (str, Path)):
        return (str(value),)
    return value


def _one_port_or_many(value: object) -> object:
    return (value,) if isinstance(value, int) and not isinstance(value, bool) else value


Paths = Annotated[tuple[str, ...], BeforeValidator(_one_or_many)]
Names = Annotated[tuple[str, ...], BeforeValidator(_one_or_many)]


BOX_OWNED = ("/proc", "/dev", "/sys", "/run/corral")
"""Guest paths a mount may not cover: the kernel's views and the agent's own directory."""


class Mount(_Model):
    """A host directory shared into the box (the spec's shared directories)."""

    host: Path
    """Directory on the host; a relative path is relative to the workspace."""
    guest: str
    """Absolute path inside the box."""
    mode: Literal["ro", "rw"] = "ro"
    """``ro`` (default) or ``rw``."""

    @model_validator(mode="after")
    def _absolute_guest(self) -> Mount:
        if not self.guest.startswith("/"):
            raise ValueError(f"guest path must be absolute, got {self.guest!r}")
        if self.host.is_absolute() and posixpath.normpath(str(self.host)) in ("/", "//"):
            raise ValueError(
                "host path / would share the whole host (its masks aside): share the "
                "directories the box needs, or use filesystem.inherit_readable for the system"
            )
        guest = posixpath.normpath(self.guest).replace("//", "/")
        owned = next((p for p in BOX_OWNED if guest == p or guest.startswith(p + "/")), None)
        if guest == "/" or owned is not None:
            raise ValueError(
                f"guest path {self.guest} is the box's own ({', '.join(BOX_OWNED)} and / are "
                "made by corral): share it elsewhere, e.g. /mnt/data"
            )
        return self


class FilesystemPolicy(_Model):
    inherit_readable: bool = True
    """See the host *system* read-only (true: ``/usr``, ``/bin``, ``/sbin``, ``/lib*``,
    ``/etc`` but its secrets, ``/opt``, ``/sys``, ``/nix``, ``/gnu``, ``/snap`` and
    ``/var/lib/dpkg``), or only a minimal root for sh/python3/node (false). Host data
    (``/home``, ``/root``, ``/srv``, ``/mnt``, ``/media``, the rest of ``/var``, any other
    top-level directory) is in neither, unless ``mounts`` or ``allow_write`` share it."""
    allow_write: Paths = ()
    """Extra host paths writable inside (at the same path). The workspace is always writable.
    A relative path is relative to the workspace (see :meth:`Policy.for_workspace`)."""
    deny_write: Paths = ()
    """Paths made read-only inside, even within writable areas (e.g. ``/workspace/.git``)."""
    deny_read: Paths = DEFAULT_DENY_READ
    """Paths masked inside: neither readable nor listable."""
    mounts: tuple[Mount, ...] = ()
    """Host directories shared into the box."""

    @field_validator("deny_read", "deny_write")
    @classmethod
    def _no_patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """A glob would be taken as a literal path and mask nothing, silently: refused."""
        for raw in value:
            if any(c in raw for c in "*?["):
                raise ValueError(
                    f"{raw!r} is a pattern: masks are paths (a pattern would mask nothing); "
                    "list each path, or mask the directory that holds them"
                )
        return value

    tmp_size: Size = 256 << 20
    """Size cap of the private ``/tmp`` (a tmpfs)."""
    root_size: Annotated[Size, Field(ge=MIN_ROOT_SIZE)] | None = 1 << 30
    """A box on an image (``image``): its root is writable, an overlay with the image
    read-only below and a per-box tmpfs of this size above (what the box changes; gone with
    the box). ``None`` (JSON ``null``): the image read-only. At least 1 MiB."""
    workspace_size: Size | None = None
    """Size cap of the workspace, for a temporary one (a sandbox started without
    ``workspace=``): corral makes it a tmpfs of this size, so a box cannot fill the host's
    disk. A host directory given as the workspace takes what its filesystem has: a cap is
    refused there (corral sets no project quotas; see SECURITY.md)."""
    workspace_inodes: int | None = Field(default=None, ge=1)
    """Cap on files and directories in a temporary workspace (the tmpfs's ``nr_inodes``);
    refused, as ``workspace_size``, for a host directory."""


NetworkMode = Literal["none", "allowlist", "ports", "full"]
MIN_HOST_PORT = 1024
"""Lowest host port :class:`PublishedPort` takes (below is privileged; 0 picks a free one)."""
_PUBLISH = re.compile(
    r"^(?:(?:\[(?P<ip6>[0-9a-fA-F:.]+)\]|(?P<ip>\d+\.\d+\.\d+\.\d+)):)?(?:(?P<host>\d+):)?(?P<box>\d+)(?:/(?P<proto>[a-z]+))?$"
)


class PublishedPort(_Model):
    """A TCP port of the box published on the host, like ``docker run -p``: connections to
    ``host_ip:host_port`` on the host reach ``127.0.0.1:box_port`` (or ``[::1]``) in the box.
    Works in every network mode, ``none`` included: the box gets no route out."""

    box_port: int = Field(gt=0, lt=65536)
    host_port: int | None = Field(default=None, ge=0, lt=65536)
    """Port on the host; None: the same as ``box_port``; 0: any free port (read the one
    chosen from :attr:`corral.Sandbox.published`). Ports below 1024 are refused."""
    host_ip: str = "127.0.0.1"
    """Host address to listen on: loopback by default. ``0.0.0.0`` or ``::`` (every
    interface: anyone who can reach the host reaches the box's server) only when given."""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return {"box_port": value}
        if not isinstance(value, str):
            return value
        m = _PUBLISH.match(value.strip())
        if m is None:
            raise ValueError(
                f"not a port to publish: {value!r} (use BOX_PORT, HOST_PORT:BOX_PORT or "
                "HOST_IP:HOST_PORT:BOX_PORT, e.g. 8080:8000 or 127.0.0.1:8080:8000)"
            )
        if m["proto"] not in (None, "tcp"):
            raise ValueError(f"{value!r}: only TCP ports can be published, not {m['proto']}")
        data: dict[str, object] = {"box_port": int(m["box"])}
        if m["host"] is not None:
            data["host_port"] = int(m["host"])
        if m["ip"] or m["ip6"]:
            data["host_ip"] = m["ip"] or m["ip6"]
        return data

    @field_validator("host_ip")
    @classmethod
    def _an_address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value.strip("[]")))
        except ValueError:
            raise ValueError(f"host_ip must be an IP address, not {value!r}") from None

    @model_validator(mode="after")
    def _unprivileged(self) -> PublishedPort:
        port = self.port_on_host
        if 0 < port < MIN_HOST_PORT:
            raise ValueError(
                f"host port {port} is privileged (below {MIN_HOST_PORT}); publish on a higher "
                f"one, e.g. {port + 8000 if port + 8000 < 65536 else 8080}:{self.box_port}"
            )
        return self

    @classmethod
    def parse(cls, text: str) -> PublishedPort:
        """``"8080:8000"`` and the other ``-p`` forms; a bad one is a :class:`PolicyError`."""
        try:
            return cls.model_validate(text)
        except ValidationError as exc:
            raise PolicyError(_describe(exc)) from None

    @property
    def port_on_host(self) -> int:
        """The host port asked for (0: any free one)."""
        return self.box_port if self.host_port is None else self.host_port

    def __str__(self) -> str:
        ip = f"[{self.host_ip}]" if ":" in self.host_ip else self.host_ip
        return f"{ip}:{self.port_on_host}->{self.box_port}/tcp"


def _one_publish_or_many(value: object) -> object:
    return (
        (value,) if isinstance(value, str | int | dict) and not isinstance(value, bool) else value
    )


class NetworkPolicy(_Model):
    mode: NetworkMode = "none"
    """``none``: loopback only. ``allowlist``: egress only through corral's proxy to
    ``allow_hosts``. ``ports``: only the host loopback ``ports`` are reachable inside.
    ``full``: user-mode NAT, with the host's loopback and private ranges blocked."""
    allow_hosts: Names = ()
    """``host`` or ``host:port`` entries; ``*.example.com`` matches every subdomain."""
    ports: Annotated[
        tuple[Annotated[int, Field(gt=0, lt=65536)], ...], BeforeValidator(_one_port_or_many)
    ] = ()
    """Host loopback TCP ports exposed inside the box at the same number."""
    allow_private: Names = ()
    """Addresses or CIDRs reachable although private, loopback or link-local."""
    publish: Annotated[tuple[PublishedPort, ...], BeforeValidator(_one_publish_or_many)] = ()
    """Box ports reachable from the host (``"8080:8000"``, ``"8000"``,
    ``"127.0.0.1:8080:8000"`` or :class:`PublishedPort`), in every mode, ``none`` included."""

    @model_validator(mode="after")
    def _distinct_host_ports(self) -> NetworkPolicy:
        seen: set[tuple[str, int]] = set()
        for p in self.publish:
            key = (p.host_ip, p.port_on_host)
            if key in seen and key[1] != 0:
                raise ValueError(f"host port {p.host_ip}:{key[1]} is published twice")
            seen.add(key)
        return self


class VmPolicy(_Model):
    """Settings of the microVM backend (ignored by the others)."""

    cpus: int = Field(default=1, gt=0, le=64)
    memory_mb: int | None = Field(default=None, ge=64)
    """RAM of the VM in MiB; default: the box's memory limit plus what the guest itself
    takes (``VM_GUEST_MEMORY_MB``), so the limit, not the VM's size, is what a box meets."""
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    """``auto`` tries KVM and falls back to software emulation (TCG)."""
    kernel: Path | None = None
    """A kernel image; default: the newest /boot/vmlinuz-* with 9p support."""
    snapshot: bool = True
    """Start VMs from a saved VM booted up to its first box-specific step (the first VM of
    each shape saves it); ``false`` boots every VM's kernel."""


class Limits(_Model):
    """Resource limits of a box. Every backend enforces the same values (see ``info()``:
    ``memory_limit_bytes``, ``cpu_quota``, ``max_pids``, ``rlimits``) or reports which it
    cannot enforce on this host; values a box cannot start with are refused here."""

    memory_bytes: Size | None = 1 << 30
    """Memory cap of the whole box (cgroup); exceeding it OOM-kills inside the box. At least
    16 MiB; the kernel counts it in pages (rounded down to 4 KiB)."""
    cpu_quota: float | None = Field(default=None, allow_inf_nan=False)
    """CPU cap in cores (0.5 = half a core), 0.01 to 4096, in steps of 0.00001 (1 us of a
    100 ms period)."""
    max_pids: int | None = 256
    """Maximum number of processes and threads in the box, its guest agent included; at
    least 4, at most 4194304 (the kernel's PID_MAX_LIMIT)."""
    exec_timeout_secs: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Default timeout of ``run`` when the call gives none."""
    kill_grace_secs: float = Field(default=2.0, ge=0, le=300, allow_inf_nan=False)
    """Seconds a command ended by its timeout or a cancellation has between SIGTERM and
    SIGKILL (both to its whole process group). 0 sends SIGKILL at once."""
    rlimits: dict[RlimitName, Annotated[int, Field(ge=0, le=MAX_RLIMIT)]] = Field(
        default_factory=lambda: _no_core_dumps()
    )
    """Per-process rlimits applied to every command (``nofile``, ``fsize``, ``core``, ...)."""

    @field_validator("memory_bytes")
    @classmethod
    def _memory_fits_a_box(cls, value: int | None) -> int | None:
        if value is not None and value < MIN_MEMORY_BYTES:
            raise ValueError(
                f"{value} bytes is below the minimum a box can start with "
                f"({_mib(MIN_MEMORY_BYTES)}: its guest agent alone uses about 8 MiB)"
            )
        return value

    @field_validator("cpu_quota")
    @classmethod
    def _quota_the_kernel_takes(cls, value: float | None) -> float | None:
        if value is not None and not MIN_CPU_QUOTA <= value <= MAX_CPU_QUOTA:
            raise ValueError(
                f"{value} cores is outside {MIN_CPU_QUOTA}..{MAX_CPU_QUOTA:g} (the kernel's "
                f"smallest CPU quota is 1 ms per {CPU_PERIOD_US // 1000} ms period)"
            )
        return value

    @field_validator("max_pids")
    @classmethod
    def _pids_for_a_command(cls, value: int | None) -> int | None:
        if value is not None and value < MIN_PIDS:
            raise ValueError(
                f"{value} is below the minimum a box can run a command with ({MIN_PIDS}: "
                "the guest agent, a shell and a two-command pipeline)"
            )
        if value is not None and value > MAX_PIDS:
            raise ValueError(f"{value} is above the kernel's limit on processes ({MAX_PIDS})")
        return value

    output_bytes: Size = 1 << 20
    """Captured output per stream; beyond it the head and the tail are kept."""


class SecurityPolicy(_Model):
    preset: Literal["baseline", "restricted"] = "baseline"
    """``restricted``: no network ever, fewer syscalls, nothing writable but the workspace."""
    landlock: bool = True
    """Landlock as a second filesystem layer where the kernel has it (Linux 5.19+): the box
    may open only what its mounts mean it to (read the system view, write the workspace,
    /tmp and ``allow_write``), whatever a mount allows. ``info()["landlock"]`` says whether
    it is enforced. ``false`` turns it off (the mounts alone then decide)."""


class ProcessTracking(_Model):
    enabled: bool = True
    max_tracked: int | None = Field(default=64, gt=0)
    """How many finished processes are remembered (running ones are always tracked)."""


class Policy(_Model):
    """Everything a sandbox may do. Immutable; build variants with ``model_copy(update=...)``."""

    backend: Literal["bwrap", "bwrap-rootless", "oci", "microvm"] = "bwrap"
    """``bwrap`` (default), ``oci`` (runc, crun or runsc) or ``microvm`` (qemu).
    ``bwrap`` runs rootless when corral is not root; ``bwrap-rootless`` asks for that mode
    anywhere (as root too, for tests)."""
    runtime: Literal["runc", "crun", "runsc"] | None = None
    """The OCI runtime of ``backend = "oci"``; default: the first that works here."""
    image: Annotated[str, Field(min_length=1, max_length=4096)] = "host"
    """The box's root: ``host`` (the host's system, read-only), or an image
    (:func:`corral.images.resolve_image`: a root directory, an OCI layout or archive, a
    registry ref), read-only, with the guest agent run by the host's own interpreter from a
    hidden path. Images run on the bwrap backend as root for now."""
    user: Literal["user", "root"] | None = None
    """Who commands run as: ``user`` (box uid 1000, unprivileged), or ``root`` (box uid 0:
    still an unprivileged uid on the host, with capabilities over the box's own namespace
    only; on the bwrap backend). Unset: the image's ``User`` where it names uid 0 or 1000
    (else the box refuses to start, saying so), else ``user``."""
    vm: VmPolicy = VmPolicy()
    filesystem: FilesystemPolicy = FilesystemPolicy()
    network: NetworkPolicy = NetworkPolicy()
    limits: Limits = Limits()
    security: SecurityPolicy = SecurityPolicy()
    process_tracking: ProcessTracking = ProcessTracking()
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of every command (on top of PATH, HOME, LANG, TERM)."""

    @field_validator("env")
    @classmethod
    def _env_the_kernel_takes(cls, env: dict[str, str]) -> dict[str, str]:
        """Names without ``=`` or NUL, values without NUL, as ``run(env=...)`` checks: the
        start failed on one as a retryable ``backend_failed``, and an empty name was
        silently dropped."""
        for name, value in env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise ValueError(
                    f"{name!r}: a name is non-empty, without '=' or NUL, and a value without NUL"
                )
        return env

    workdir: str = DEFAULT_WORKDIR
    """Where the workspace appears inside the box, and the default cwd."""
    audit_log: Path | None = None
    """A JSONL file on the host receiving every command, tool call, approval decision,
    denied operation, network decision and detected violation."""
    secrets_file: Path | None = None
    """``NAME=value`` lines on the host, for ``{{secret:NAME}}`` handles of the agent tools
    (with ``CORRAL_SECRET_<NAME>`` variables). Values never enter the box's environment
    unless a tool call names their handle."""
    _loaded_from: Path | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal fields, equal policies: where one was loaded from is not a field."""
        if not isinstance(other, Policy):
            return NotImplemented
        return self.__dict__ == other.__dict__

    @property
    def loaded_from(self) -> Path | None:
        """The policy file this policy was read from (:meth:`load`), unless it was loaded
        with ``trust_writable=True``: a sandbox refuses to start when that file lies in an
        area its box can write (a box could rewrite the policy a later run loads)."""
        return self._loaded_from

    @model_validator(mode="after")
    def _restricted_is_read_only(self) -> Policy:
        if self.security.preset == "restricted":
            if self.filesystem.allow_write:
                raise ValueError("security.preset 'restricted' allows no filesystem.allow_write")
            if any(m.mode == "rw" for m in self.filesystem.mounts):
                raise ValueError("security.preset 'restricted' allows no rw mounts")
            if self.network.mode != "none":
                raise ValueError("security.preset 'restricted' allows no network")
        if self.runtime is not None and self.backend != "oci":
            raise ValueError(f"runtime {self.runtime!r} needs backend 'oci'")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path inside the box: {self.workdir!r}")
        workdir = posixpath.normpath(self.workdir)
        masked = [posixpath.normpath(os.path.expanduser(d)) for d in self.filesystem.deny_read]
        for i, m in enumerate(self.filesystem.mounts):
            host = posixpath.normpath(str(m.host))
            hidden = next((d for d in masked if host == d), None)  # below it may be shared
            if m.host.is_absolute() and hidden is not None:
                raise ValueError(
                    f"filesystem.mounts[{i}].host: {m.host} is masked by filesystem.deny_read "
                    f"({hidden}): the box would see nothing of it; take {hidden} out of "
                    "deny_read to share it"
                )
            guest = posixpath.normpath(m.guest)
            if guest == workdir or guest.startswith(workdir.rstrip("/") + "/"):
                where = "is" if guest == workdir else "is inside"
                raise ValueError(
                    f"filesystem.mounts[{i}].guest: {m.guest} {where} the workspace ({workdir}), "
                    "which the box already has: share the directory elsewhere (e.g. "
                    "/mnt/data), or make it the workspace"
                )
        problem = vm_memory_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Validate a mapping; errors become one PolicyError naming every bad field. A
        mapping in the spec's ``SandboxConfig`` shape is mapped first (see
        :meth:`from_spec_config`)."""
        if specconfig.is_spec_config(data):
            return cls.from_spec_config(data)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PolicyError(_describe(exc)) from None

    @classmethod
    def from_spec_config(cls, data: Mapping[str, Any]) -> Policy:
        """A policy from the spec's ``SandboxConfig`` (``enabled``, ``isolation``,
        ``filesystem``, ``network.enabled``, ``security.standard``, ``resources``,
        ``process_tracking``), mapped as :mod:`corral.specconfig` and docs/spec-config.md
        say; corral's own fields may stand beside them. Errors name the spec's fields."""
        try:
            mapped = specconfig.spec_to_policy_dict(data, DEFAULT_DENY_READ)
        except specconfig.SpecConfigError as exc:
            raise PolicyError(f"invalid policy: {exc}") from None
        try:
            return cls.model_validate(mapped)
        except ValidationError as exc:
            raise PolicyError(
                _describe(exc, lambda where: specconfig.spec_field(where, data))
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, trust_writable: bool = False) -> Policy:
        """Load a policy file (``corral run --policy corral.toml``): TOML, or JSON when the
        name ends in ``.json``.

        A box must not write the policy of its next run: a sandbox refuses to start (a
        :class:`PolicyError`) when the file lies in its workspace, an ``allow_write`` path
        or an ``rw`` mount (:attr:`loaded_from`). ``trust_writable=True`` (``corral run
        --trust-writable-policy``) takes it anyway: for a file you review before each run."""
        policy = cls._read(Path(path))
        if not trust_writable:
            policy._loaded_from = Path(os.path.abspath(path))
        return policy

    @classmethod
    def _read(cls, p: Path) -> Policy:
        try:
            # O_NONBLOCK: a FIFO (left in a workspace) must not hang the CLI; only a regular
            # file is read.
            with open(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if stat.S_ISDIR(mode):
                    raise IsADirectoryError(p)
                if not stat.S_ISREG(mode):
                    raise PolicyError(f"policy file {p} is not a regular file")
                text = f.read().decode()
        except FileNotFoundError:
            raise PolicyError(f"policy file not found: {p}") from None
        except IsADirectoryError:
            raise PolicyError(
                f"policy file {p} is a directory; give a .toml or .json file"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"policy file {p} cannot be read: {exc}") from None
        data: object
        if p.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PolicyError(f"policy file {p} is not valid JSON: {exc}") from None
        else:
            import tomllib  # only for a policy file

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as exc:
                raise PolicyError(f"policy file {p} is not valid TOML: {exc}") from None
        if not isinstance(data, dict):
            raise PolicyError(f"policy file {p} must hold a table of fields, not {data!r:.40}")
        try:
            return cls.from_dict(data)
        except PolicyError as exc:
            raise PolicyError(f"{p}: {exc.message}") from None

    def for_workspace(self, workspace: str | os.PathLike[str]) -> Policy:
        """This policy with relative host paths resolved against ``workspace``: an
        ``allow_write`` entry inside the workspace is dropped (the workspace is writable
        already), one outside it (``../shared``) becomes absolute; a mount's relative ``host``
        becomes absolute. ``deny_*`` entries stay relative: they name paths in the box's
        workspace. Returns ``self`` when nothing is relative."""
        fs = self.filesystem
        if all(_anchored(p) for p in fs.allow_write) and all(
            m.host.is_absolute() for m in fs.mounts
        ):
            return self
        ws = Path(workspace).resolve()
        allow: list[str] = []
        for raw in fs.allow_write:
            if _anchored(raw):
                allow.append(raw)
                continue
            path = Path(os.path.normpath(ws / raw))
            if path != ws and not path.is_relative_to(ws):
                allow.append(str(path))
        mounts = tuple(
            m if m.host.is_absolute() else m.model_copy(update={"host": ws / m.host})
            for m in fs.mounts
        )
        # Rebuilt through validation, not model_copy: the result is checked like any policy.
        data = self.model_dump()
        data["filesystem"]["allow_write"] = tuple(allow)
        data["filesystem"]["mounts"] = [m.model_dump() for m in mounts]
        return Policy.model_validate(data).derived_from(self)

    def derived_from(self, original: Policy) -> Policy:
        """This policy, remembering the file ``original`` was loaded from (for a policy
        rebuilt from another's fields: the check of :attr:`loaded_from` still applies)."""
        if self._loaded_from == original._loaded_from:
            return self
        copy = self.model_copy()
        copy._loaded_from = original._loaded_from
        return copy


def _anchored(path: str) -> bool:
    """Absolute or under the home (``~``): not relative to the workspace."""
    return path.startswith(("/", "~/")) or path == "~"


def vm_room(memory_mb: int) -> int:
    """The largest memory limit (bytes) a VM of ``memory_mb`` MiB holds beside the guest's
    own use (:data:`VM_GUEST_MEMORY_MB` + 1/8 of the limit)."""
    return max(0, ((memory_mb - VM_GUEST_MEMORY_MB) << 20) * 8 // 9)


def vm_memory_mb(policy: Policy) -> int:
    """RAM of a microVM box in MiB: ``vm.memory_mb``, or derived from the memory limit (the
    smallest multiple of 64 MiB whose :func:`vm_room` holds the limit)."""
    if policy.vm.memory_mb is not None:
        return policy.vm.memory_mb
    limit = policy.limits.memory_bytes
    if limit is None:
        return VM_DEFAULT_MEMORY_MB
    wanted = VM_GUEST_MEMORY_MB + -(-(limit + limit // 8) // (1 << 20))
    ram = -(-wanted // VM_MEMORY_STEP_MB) * VM_MEMORY_STEP_MB
    while vm_room(ram) < limit:  # rounding: at most one more step
        ram += VM_MEMORY_STEP_MB
    return ram


def vm_memory_problem(policy: Policy) -> str | None:
    """Why a microVM's RAM cannot hold the box's memory limit (a limit the VM's size would
    silently override), or None."""
    limit = policy.limits.memory_bytes
    if policy.backend != "microvm" or limit is None or policy.vm.memory_mb is None:
        return None
    room = vm_room(policy.vm.memory_mb)
    if limit <= room:
        return None
    return (
        f"limits.memory_bytes: {_mib(limit)} does not fit in the VM: vm.memory_mb "
        f"{policy.vm.memory_mb} holds at most {room >> 20} MiB beside the guest's own use "
        f"({VM_GUEST_MEMORY_MB} MiB + 1/8 of the limit); lower the limit, raise vm.memory_mb, "
        "or leave vm.memory_mb unset to size the VM from the limit"
    )


def _describe(exc: ValidationError, rename: Callable[[str], str] | None = None) -> str:
    parts = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule across fields: its message names them
            parts.append(msg)
            continue
        where = ".".join(str(x) for x in err["loc"])
        if rename is not None:
            where = rename(where)
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see corral.Policy for the fields)"
        parts.append(f"{where}: {msg} (got {err.get('input')!r})")
    return "invalid policy: " + "; ".join(parts)
