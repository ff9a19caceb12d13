"""The image store: unpacked image roots cached by layer chain, shared between images.

Layout (``<cache>/images``, where ``<cache>`` is :func:`corral.backends.host.state.cache_root`,
``/var/cache/corral`` for root; ``CORRAL_IMAGE_STORE`` overrides the whole path)::

    roots/<chain id>/   the root after a layer and every layer below it (read-only use)
    refs/<key>.json     one image: its ref, manifest digest, config, layer chain
    workspaces/<name>   a snapshot's copy of its box's workspace (a layer tar)
    tmp/<pid>-<rand>/   work in progress, renamed into roots/ when complete
    lock                flock: one writer at a time

A root is keyed by the OCI *chain id* of its layers (``ChainID(L0) = DiffID(L0)``,
``ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln))``), so two images with the same
first layers share those roots; the root for layer *n* starts as a hard-link clone of the root
for layer *n-1* (files are never written in place: a layer replaces a file by unlinking it),
so shared files take their space once.

Publication is atomic: a layer is unpacked into ``tmp/``, its compressed and uncompressed
digests are compared with the manifest's and the config's, and only then is it renamed into
``roots/``; any error removes the temporary directory whole, so the cache never holds a
half-unpacked root. A crashed writer's ``tmp/`` entries are swept by the next writer (the
pid in the name is dead). The store's top directory is ``0700``: files of an image (owned
by the image's uids when unpacked as root) are reachable only through a box's mount.

:func:`corral.images.resolve_image` maps a ref to a root through :meth:`ImageStore.resolve`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from corral import errors
from corral.backends.host.state import cache_root, pid_alive, replace_file
from corral.images import oci, registry
from corral.images.unpack import Limits, clone_tree, remove_tree, unpack_layer

EMPTY_CHAIN = "sha256:" + hashlib.sha256(b"").hexdigest()
"""The chain id of an image without layers (an empty root)."""


def store_root() -> Path:
    explicit = os.environ.get("CORRAL_IMAGE_STORE")
    return Path(explicit) if explicit else cache_root() / "images"


def chain_ids(diff_ids: list[str] | tuple[str, ...]) -> list[str]:
    chains: list[str] = []
    for diff_id in diff_ids:
        if not chains:
            chains.append(diff_id)
        else:
            chains.append(oci.sha256(f"{chains[-1]} {diff_id}".encode()))
    return chains


@dataclass(frozen=True)
class ImageRecord:
    """One image in the store."""

    ref: str
    digest: str
    """The manifest's digest (a ``docker save`` tarball's: its config's, docker's image id)."""
    config_digest: str
    source: str
    """Where it came from: ``registry``, ``oci-layout`` or ``archive``."""
    layers: tuple[str, ...]
    """The layers' uncompressed digests (diff ids), bottom first."""
    size: int
    """Bytes of the layers as stored (compressed) in the source."""
    created: float
    config: dict[str, Any] = field(default_factory=dict)
    """The image config's ``config`` object (``Env``, ``WorkingDir``, ``User``, ``Cmd``...)."""
    architecture: str = ""
    os: str = ""
    workspace: str = ""
    """A snapshot's copy of its box's workspace: a layer tar's name under ``workspaces/``
    (``Sandbox.snapshot(workspace=True)``), or empty."""
    cow: str = ""
    """A snapshot kept in the copy-on-write store (:mod:`corral.backends.host.cowstore`):
    its subvolume's name there, holding the box's upper layer over this image's root; or
    empty (the image is its layers alone)."""
    plain: bool = False
    """A snapshot kept in the copy-on-write store whose changes are in its layers too
    (:meth:`ImageStore.materialize`): its root alone is the whole image."""

    @property
    def chain(self) -> str:
        chains = chain_ids(self.layers)
        return chains[-1] if chains else EMPTY_CHAIN

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = list(self.layers)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageRecord:
        data = dict(data)
        data["layers"] = tuple(data.get("layers") or ())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def is_path(ref: str) -> bool:
    """A ref naming a file or directory: it starts with ``/``, ``./``, ``../`` or ``~``
    (a bare ``busybox`` is always a registry name, as in docker)."""
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def split_path_tag(ref: str) -> tuple[Path, str | None]:
    path = Path(os.path.expanduser(ref))
    if not os.path.lexists(path):
        base, colon, tag = ref.rpartition(":")
        if colon and "/" not in tag and os.path.lexists(os.path.expanduser(base)):
            return Path(os.path.expanduser(base)), tag
    return path, None


def _key(ref: str) -> str:
    return hashlib.sha256(ref.encode()).hexdigest()[:40]


class ImageStore:
    """Images unpacked on this host. Blocking: call it from a thread in async code."""

    def __init__(self, root: Path | None = None, limits: Limits | None = None) -> None:
        self.root = Path(root) if root is not None else store_root()
        self.limits = limits or Limits()

    # -- reading ---------------------------------------------------------------------------

    def rootfs(self, record: ImageRecord) -> Path:
        return self.root / "roots" / record.chain.removeprefix("sha256:")

    def get(self, ref: str) -> ImageRecord | None:
        """The image stored under ``ref`` (exactly), or None."""
        try:
            data = json.loads((self.root / "refs" / f"{_key(ref)}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        record = ImageRecord.from_json(data)
        return record if record.ref == ref and self.rootfs(record).is_dir() else None

    def list(self) -> list[ImageRecord]:
        records = []
        refs = self.root / "refs"
        for path in sorted(refs.glob("*.json")) if refs.is_dir() else ():
            try:
                records.append(ImageRecord.from_json(json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(records, key=lambda r: r.ref)

    def find(self, name: str) -> ImageRecord:
        """An image by ref, by digest or by a digest prefix of 12+ hex digits (like docker)."""
        record = self.get(name)
        if record is not None:
            return record
        hexpart = name.removeprefix("sha256:")
        matches = []
        if len(hexpart) >= 12 and all(c in "0123456789abcdef" for c in hexpart):
            matches = [
                r for r in self.list() if r.digest.removeprefix("sha256:").startswith(hexpart)
            ]
        if len({r.digest for r in matches}) == 1:
            return matches[0]
        if matches:
            raise errors.ImageError(
                f"{name!r} names several images: " + ", ".join(r.ref for r in matches),
                code=errors.ErrorCode.INVALID_INPUT,
            )
        raise errors.ImageNotFound(f"no image {name!r} in the store (see corral image ls)")

    # -- writing ---------------------------------------------------------------------------

    def _ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        for sub in ("roots", "refs", "tmp", "workspaces"):
            (self.root / sub).mkdir(exist_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure()
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._sweep_tmp()
            yield
        finally:
            os.close(fd)

    def _sweep_tmp(self) -> None:
        for entry in (self.root / "tmp").iterdir():
            pid = entry.name.partition("-")[0]
            if not pid.isdigit() or not pid_alive(int(pid)):
                remove_tree(entry)

    @contextmanager
    def scratch(self) -> Iterator[Path]:
        """A private directory under ``tmp/`` (removed whole on the way out)."""
        self._ensure()
        path = self.root / "tmp" / f"{os.getpid()}-{secrets.token_hex(6)}"
        path.mkdir(mode=0o700)
        try:
            yield path
        finally:
            if os.path.lexists(path):
                remove_tree(path)

    def add(self, ref: str, source: oci.ImageSource, kind: str) -> ImageRecord:
        """Unpack ``source``'s layers not yet in the store and record it as ``ref``."""
        with self._locked():
            self._unpack(source)
            size = sum(layer.size or 0 for layer in source.layers)
            record = ImageRecord(
                ref=ref,
                digest=source.digest,
                config_digest=source.config_digest,
                source=kind,
                layers=tuple(layer.diff_id for layer in source.layers),
                size=size,
                created=time.time(),
                config=dict(source.config.get("config") or {}),
                architecture=str(source.config.get("architecture") or ""),
                os=str(source.config.get("os") or ""),
            )
            self._record(record)
            return record

    def _record(self, record: ImageRecord) -> None:
        path = self.root / "refs" / f"{_key(record.ref)}.json"
        replace_file(path, json.dumps(record.to_json(), indent=1).encode(), 0o644)

    def commit(
        self,
        ref: str,
        base: ImageRecord | None,
        layers: Sequence[Path],
        config: dict[str, Any],
        *,
        source: str = "build",
        workspace: Path | None = None,
        keep: tuple[str, str] | None = None,
    ) -> ImageRecord:
        """A new image: ``base`` (or an empty root) with ``layers`` (tar files, gzip or not)
        on top and ``config`` as its config object, recorded as ``ref``. Its layers' blobs
        are not kept (the store holds roots), so it can be run and inspected, not pushed; its
        digest is that of a manifest made for it. ``workspace``: a layer tar of a box's
        workspace, moved into the store with the image (a snapshot's). ``keep``: the
        ``(workspace, cow)`` fields of a snapshot made plain (:meth:`materialize`)."""
        if base is not None and base.cow and not base.plain:
            base = self.materialize(base)  # its root alone lacks the snapshot's changes
        with self._locked():
            kept, cow = keep or ("", "")
            if workspace is not None:
                kept = f"{_key(ref)}-{secrets.token_hex(6)}.tar"
                os.rename(workspace, self.root / "workspaces" / kept)
            diff_ids = list(base.layers) if base is not None else []
            size = base.size if base is not None else 0
            for layer in layers:
                below = chain_ids(diff_ids)
                with self.scratch() as tmp:
                    work = tmp / "root"
                    if below:
                        clone_tree(self.root / "roots" / below[-1].removeprefix("sha256:"), work)
                    else:
                        work.mkdir(mode=0o755)
                    with open(layer, "rb") as blob:
                        got = unpack_layer(blob, work, self.limits)
                    diff_ids.append(got.uncompressed)
                    size += got.size
                    target = self.root / "roots" / chain_ids(diff_ids)[-1].removeprefix("sha256:")
                    if not target.is_dir():
                        os.rename(work, target)
            if not diff_ids:
                self._unpack(oci.ImageSource("", "", {}, ()))
            image_config = {
                "architecture": base.architecture if base else "",
                "os": base.os if base else "linux",
                "config": config,
                "rootfs": {"type": "layers", "diff_ids": diff_ids},
            }
            config_digest = oci.sha256(json.dumps(image_config, sort_keys=True).encode())
            manifest = {"config": config_digest, "layers": diff_ids}
            record = ImageRecord(
                ref=ref,
                digest=oci.sha256(json.dumps(manifest, sort_keys=True).encode()),
                config_digest=config_digest,
                source=source,
                layers=tuple(diff_ids),
                size=size,
                created=time.time(),
                config=config,
                architecture=str(image_config["architecture"]),
                os=str(image_config["os"]),
                workspace=kept,
                cow=cow,
                plain=keep is not None,
            )
            replaced = self.get(ref)
            self._record(record)
            self._drop_replaced(replaced)
            return record

    def commit_cow(
        self,
        ref: str,
        base: ImageRecord,
        subvolume: Path,
        *,
        mount_points: frozenset[str] = frozenset(),
        workspace: Path | None = None,
    ) -> ImageRecord:
        """A snapshot kept in the copy-on-write store: a read-only snapshot of the box's
        ``subvolume`` (O(1)) recorded as ``ref`` over ``base``'s root (``base`` itself when
        it is such a snapshot: the box's upper already holds all it changed). The box must
        be paused. ``mount_points``: the backend's, left out if it is ever made plain."""
        from corral.backends.host import cowstore

        store = cowstore.root()
        if store is None:
            raise errors.ImageError("no copy-on-write store on this host")
        with self._locked():
            name = f"{os.getpid()}-{secrets.token_hex(8)}"
            cowstore.take_snapshot(store, subvolume, name, self.root, sorted(mount_points))
            kept = ""
            if workspace is not None:
                kept = f"{_key(ref)}-{secrets.token_hex(6)}.tar"
                os.rename(workspace, self.root / "workspaces" / kept)
            manifest = {"base": base.digest, "cow": name}
            record = dataclasses.replace(
                base,
                ref=ref,
                digest=oci.sha256(json.dumps(manifest, sort_keys=True).encode()),
                source="snapshot",
                created=time.time(),
                workspace=kept,
                cow=name,
                plain=False,
            )
            replaced = self.get(ref)
            self._record(record)
            self._drop_replaced(replaced)
            return record

    def cow_of(self, record: ImageRecord) -> Path | None:
        """The subvolume of a snapshot kept in the copy-on-write store (None: not one, or
        gone)."""
        from corral.backends.host import cowstore

        return cowstore.snapshot_path(record.cow) if record.cow else None

    def materialize(self, record: ImageRecord) -> ImageRecord:
        """A snapshot kept in the copy-on-write store as an image of plain layers too (for
        what needs a root directory: a read-only root, a build ``FROM`` it): its upper
        written as a layer (read as hostile: :mod:`corral.images.export`) and committed on
        its image, under the same ref (the subvolume kept for fast forks). Once."""
        if record.plain or not record.cow:
            return record
        from corral.backends.host import cowstore
        from corral.images.export import write_layer

        upper = self.cow_of(record)
        if upper is None:
            raise errors.ImageNotFound(
                f"snapshot {record.ref}'s changes are gone from the copy-on-write store "
                f"({cowstore.image_file()}); corral image rm it"
            )
        skip = cowstore.snapshot_mount_points(record.cow)
        base = dataclasses.replace(record, cow="", workspace="", plain=False)
        with self.scratch() as tmp:
            layer = tmp / "layer.tar"
            with open(layer, "wb") as out:
                write_layer(upper / "upper", out, skip=skip)
            return self.commit(
                record.ref,
                base,
                [layer],
                dict(record.config),
                source="snapshot",
                keep=(record.workspace, record.cow),
            )

    def workspace_of(self, record: ImageRecord) -> Path | None:
        """The layer tar of a snapshot's workspace, or None."""
        if not record.workspace or "/" in record.workspace:
            return None
        path = self.root / "workspaces" / record.workspace
        return path if path.is_file() else None

    def _unpack(self, source: oci.ImageSource) -> None:
        roots = self.root / "roots"
        chains = chain_ids([layer.diff_id for layer in source.layers])
        if not chains:
            empty = roots / EMPTY_CHAIN.removeprefix("sha256:")
            if not empty.is_dir():
                with self.scratch() as tmp:
                    (tmp / "root").mkdir()
                    os.rename(tmp / "root", empty)
            return
        have = -1
        for i in range(len(chains) - 1, -1, -1):
            if (roots / chains[i].removeprefix("sha256:")).is_dir():
                have = i
                break
        for i in range(have + 1, len(chains)):
            layer = source.layers[i]
            with self.scratch() as tmp:
                work = tmp / "root"
                if i == 0:
                    work.mkdir(mode=0o755)
                else:
                    clone_tree(roots / chains[i - 1].removeprefix("sha256:"), work)
                with layer.open() as blob:
                    got = unpack_layer(blob, work, self.limits)
                if layer.digest is not None and got.compressed != layer.digest:
                    raise errors.DigestMismatch(
                        f"layer {layer.digest} hashes to {got.compressed}: the download is "
                        "corrupt or the source lies"
                    )
                if got.uncompressed != layer.diff_id:
                    raise errors.DigestMismatch(
                        f"layer {layer.digest or i} unpacks to {got.uncompressed}, not to the "
                        f"config's diff id {layer.diff_id}"
                    )
                os.rename(work, roots / chains[i].removeprefix("sha256:"))

    # -- sources ---------------------------------------------------------------------------

    def resolve(self, ref: str, *, pull: bool = True) -> ImageRecord | None:
        """The stored image for ``ref``: an OCI layout directory or an archive (re-read each
        time: cheap when its layers are stored), or a registry ref (pulled when not stored
        and ``pull``). None for a directory that is neither (a plain root: not the store's)."""
        if is_path(ref):
            return self.add_path(ref)
        record = self.get(str(registry.parse_ref(ref)))
        if record is not None or not pull:
            return record
        return self.pull(ref)

    def add_path(self, ref: str) -> ImageRecord | None:
        """Store the image of an OCI layout dir or an archive (``PATH`` or ``PATH:TAG``)."""
        path, tag = split_path_tag(ref)
        if path.is_dir():
            if not oci.is_layout(path):
                return None
            source, kind = oci.read_layout(path, tag), "oci-layout"
        elif path.is_file():
            source, kind = oci.read_archive(path, tag), "archive"
        else:
            raise errors.ImageNotFound(f"no image at {path}")
        key = f"{kind}:{path.resolve()}" + (f":{tag}" if tag else "")
        record = self.get(key)
        if record is not None and record.digest == source.digest:
            return record
        return self.add(key, source, kind)

    def pull(self, ref: str, *, tls_verify: bool | None = None) -> ImageRecord:
        """Pull ``ref`` from its registry (again, if stored: a tag may have moved). When the
        registry's manifest is one the store already has, nothing is downloaded."""
        parsed = registry.parse_ref(ref)
        digest = registry.manifest_digest(parsed, tls_verify=tls_verify)
        for known in self.list():
            if known.digest == digest and self.rootfs(known).is_dir():
                with self._locked():
                    record = dataclasses.replace(
                        known, ref=str(parsed), source="registry", created=time.time()
                    )
                    self._record(record)
                return record
        with self.scratch() as tmp:
            layout = tmp / "layout"
            registry.pull(parsed, layout, tls_verify=tls_verify)
            source = oci.read_layout(layout, "image")
            return self.add(str(parsed), source, "registry")

    def remove(self, name: str) -> ImageRecord:
        """Forget an image (by ref or digest) and drop the roots no other image uses."""
        record = self.find(name)
        with self._locked():
            for path in (self.root / "refs").glob("*.json"):
                try:
                    other = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if other.get("ref") == record.ref:
                    path.unlink()
            self._gc()
        return record

    def _gc(self) -> None:
        keep = {EMPTY_CHAIN.removeprefix("sha256:")}
        for record in self.list():
            keep.update(c.removeprefix("sha256:") for c in chain_ids(record.layers))
        for entry in (self.root / "roots").iterdir():
            if entry.name not in keep:
                remove_tree(entry)
        self._gc_workspaces()
        self._gc_cows()

    def forget(self, ref: str) -> None:
        """Remove the image ``ref`` (exactly) and what only it used, without the full
        collection :meth:`remove` makes (a fork's own snapshot, when its forks are closed)."""
        with self._locked():
            record = self.get(ref)
            if record is None:
                return
            (self.root / "refs" / f"{_key(ref)}.json").unlink(missing_ok=True)
            self._drop_replaced(record)
            if record.plain:  # its exported layer's root
                self._gc()

    def _drop_replaced(self, old: ImageRecord | None) -> None:
        """What only ``old`` (a record just replaced under its ref) used: its workspace copy,
        its snapshot in the copy-on-write store."""
        if old is None or not (old.workspace or old.cow):
            return
        from corral.backends.host import cowstore

        records = self.list()
        if old.workspace and all(r.workspace != old.workspace for r in records):
            (self.root / "workspaces" / old.workspace).unlink(missing_ok=True)
        store = cowstore.root() if old.cow else None
        if store is not None and all(r.cow != old.cow for r in records):
            cowstore.drop_snapshot(store, old.cow)

    def _gc_cows(self) -> None:
        """Drop this store's snapshots in the copy-on-write store that no image records."""
        from corral.backends.host import cowstore

        if not cowstore.mounted():
            return
        used = {record.cow for record in self.list() if record.cow}
        cowstore.drop_unused(self.root, used)

    def _gc_workspaces(self) -> None:
        used = {record.workspace for record in self.list()}
        workspaces = self.root / "workspaces"
        for entry in workspaces.iterdir() if workspaces.is_dir() else ():
            if entry.name not in used:
                entry.unlink(missing_ok=True)
