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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def resolve_image(ref: str) -> ResolvedImage:
    """The root and config ``ref`` names (see the module docstring)."""
    if ref == HOST:
        return ResolvedImage(ref, None, ImageConfig())
    from corral.images.store import ImageStore, is_path

    store = ImageStore()
    record = store.resolve(ref)
    if record is not None:
        return ResolvedImage(
            ref, store.rootfs(record), ImageConfig.from_oci(record.config, record.digest)
        )
    if is_path(ref):  # a directory that is no OCI layout: a plain root
        return ResolvedImage(ref, Path(ref).expanduser().resolve(), ImageConfig())
    raise errors.ImageNotFound(f"no image {ref!r}")
