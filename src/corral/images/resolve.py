"""What an image reference names: a root directory for the box and the image's config.

``resolve_image(ref)`` takes:

* ``host``: the host's own root (``rootfs`` None), today's behaviour;
* a path (``/...``, ``./...``, ``~/...``) to a plain root directory (one made by
  ``mmdebstrap``, say): used as it is, with an empty config;
* a path to an OCI image layout directory or to an OCI archive / ``docker save`` tarball
  (``PATH`` or ``PATH:TAG``): unpacked into the image store;
* a registry ref (``busybox``, ``127.0.0.1:5000/tools:1``, ``name@sha256:...``): taken from
  the store, pulled first when it is not there.

The store (:mod:`corral.images.store`) does the unpacking; this module only maps a ref to a
root and a config. Blocking: call it from a thread in async code.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from corral import errors

HOST = "host"


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a box honours (the policy wins over each)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cmd: list[str] | None = None
    """``Entrypoint`` followed by ``Cmd``, as ``docker run`` runs them; None if both empty."""
    digest: str | None = None
    """The image's manifest digest (None for ``host`` and a plain directory)."""

    @classmethod
    def from_oci(cls, config: dict[str, Any], digest: str | None = None) -> ImageConfig:
        env: dict[str, str] = {}
        for item in config.get("Env") or ():
            key, eq, value = str(item).partition("=")
            if eq and key:
                env[key] = value
        cmd = [str(a) for a in (config.get("Entrypoint") or [])] + [
            str(a) for a in (config.get("Cmd") or [])
        ]
        return cls(
            env=env,
            workdir=str(config.get("WorkingDir") or "") or None,
            user=str(config.get("User") or "") or None,
            cmd=cmd or None,
            digest=digest,
        )


@dataclass(frozen=True)
class ResolvedImage:
    ref: str
    rootfs: Path | None
    """A read-only root directory, or None for ``host``."""
    config: ImageConfig
    cow: Path | None = None
    """A snapshot's subvolume in the copy-on-write store (:mod:`corral.backends.host.cowstore`):
    the upper layer a writable root starts as, over ``rootfs``; only when asked for."""


def resolve_image(ref: str, *, cow: bool = False) -> ResolvedImage:
    """The root and config ``ref`` names (see the module docstring). A snapshot kept in the
    copy-on-write store is its image's root plus a subvolume: ``cow=True`` (a caller that
    mounts a writable root over it, as bwrap does) gets both; any other gets a plain root,
    the snapshot's changes written into the store as a layer first (once)."""
    if ref == HOST:
        return ResolvedImage(ref, None, ImageConfig())
    from corral.images.store import ImageStore, is_path

    store = ImageStore()
    record = store.resolve(ref)
    if record is not None:
        upper = store.cow_of(record) if record.cow and cow else None
        if record.cow and upper is None:
            record = store.materialize(record)  # once; a no-op when it is plain already
        config = ImageConfig.from_oci(record.config, record.digest)
        return ResolvedImage(ref, store.rootfs(record), config, upper)
    if is_path(ref):  # a directory that is no OCI layout: a plain root
        root = Path(ref).expanduser().resolve()
        if root == Path("/"):
            # Its owners show in the box as they are: host root's files would be box root's.
            raise errors.PolicyError(
                f"policy.image {ref!r} is the host's own root: use image 'host' (read-only, "
                "its secrets masked) or a root directory made for boxes"
            )
        return ResolvedImage(ref, root, ImageConfig())
    raise errors.ImageNotFound(f"no image {ref!r}")


BoxUser = Literal["user", "root"]
"""corral's box users: ``user`` (box uid 1000, the default) and ``root`` (box uid 0)."""
_BOX_UIDS: dict[int, BoxUser] = {0: "root", 1000: "user"}
_PASSWD_MAX = 1 << 20


def resolve_root(ref: str, *, cow: bool = False) -> ResolvedImage | None:
    """:func:`resolve_image` for a backend about to mount the box's root: None when ``ref``
    has no root of its own (the host's system), a BackendError when its root is not a
    directory. Blocking (a registry ref not stored yet is pulled)."""
    resolved = resolve_image(ref, cow=cow)
    if resolved.rootfs is None:
        return None
    if not resolved.rootfs.is_dir():
        raise errors.BackendError(f"policy.image {ref!r}: {resolved.rootfs} is not a directory")
    return resolved


def _image_ids(rootfs: Path, file: str, name: str) -> int | None:
    """The id of ``name`` in the image's ``/etc/passwd`` or ``/etc/group`` (None when the
    file or the name is not there). Read on the host beneath the image's root without
    following any of its symlinks, a regular file only, at most 1 MiB."""
    from corral.backends.host import safepath

    try:
        fd = safepath.open_beneath(rootfs, file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        text = f.read(_PASSWD_MAX).decode(errors="replace")
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    return None


def box_user(image: ResolvedImage, wanted: BoxUser | None) -> BoxUser:
    """Who a box's commands run as: the policy's ``user`` when it names one, else the
    image's ``User`` (``NAME``, ``UID``, ``NAME:GROUP`` or ``UID:GID``, names looked up in
    the image's own ``/etc/passwd`` and ``/etc/group``) mapped to corral's box users (uid 0:
    ``root``, uid 1000: ``user``), else ``user``. A ``User`` that maps to neither is a
    :class:`~corral.errors.PolicyError` saying how to choose."""
    if wanted is not None:
        return wanted
    spec = image.config.user
    if not spec or image.rootfs is None:
        return "user"
    name, _, group = spec.partition(":")
    uid = int(name) if name.isdigit() else _image_ids(image.rootfs, "etc/passwd", name)
    gid = (
        None
        if not group
        else int(group)
        if group.isdigit()
        else _image_ids(image.rootfs, "etc/group", group)
    )
    who = _BOX_UIDS.get(uid) if uid is not None else None
    if who is None or (group and gid != uid):
        found = "not in its /etc/passwd" if uid is None else f"uid {uid}"
        if group and uid is not None and who is not None:
            found = f"uid {uid}, gid {gid if gid is not None else 'not in its /etc/group'}"
        raise errors.PolicyError(
            f"image {image.ref!r} runs as User {spec!r} ({found}), which is none of corral's "
            "box users (root = uid 0:0, user = uid 1000:1000): set the policy's user to "
            "'user' or 'root' (corral run --user) to run it as one of them"
        )
    return who
