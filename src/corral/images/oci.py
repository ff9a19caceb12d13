"""Reading images from the formats on disk: an OCI image layout directory, an OCI archive
(the same layout in a tar file) and a ``docker save`` tarball.

Each reader returns an :class:`ImageSource`: the image's manifest digest, its config (parsed
and digest-checked) and one opener per layer. Manifests, indexes and configs are small and
are checked against their digests as they are read; layers are streamed and checked by the
unpacker (:mod:`corral.images.unpack`) against the manifest's digest and the config's
``diff_ids``.

Which image of a layout or an archive holding several: the one whose
``org.opencontainers.image.ref.name`` annotation (or docker ``RepoTags`` entry) is the tag
asked for, else the only one there is. An index (multi-platform image) picks
``linux/<this machine's architecture>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tarfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from corral import errors

MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
REF_NAME = "org.opencontainers.image.ref.name"
_MAX_JSON = 8 << 20
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}

Opener = Callable[[], AbstractContextManager[IO[bytes]]]


@dataclass(frozen=True)
class Layer:
    """One layer: its blob digest (None in a ``docker save`` tarball, which names layers by
    path), its uncompressed digest (the config's diff_id) and how to read it."""

    digest: str | None
    diff_id: str
    size: int | None
    open: Opener


@dataclass(frozen=True)
class ImageSource:
    digest: str
    """The manifest's digest (a ``docker save`` tarball has none: its config's digest,
    docker's image id)."""
    config_digest: str
    config: dict[str, Any]
    layers: tuple[Layer, ...]


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str, what: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise errors.ImageError(f"{what} has a digest corral does not support: {digest!r}")
    return hexpart


def _verified(data: bytes, digest: str, what: str) -> bytes:
    check_digest(digest, what)
    if sha256(data) != digest:
        raise errors.DigestMismatch(f"{what} does not match its digest {digest}")
    return data


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        raise errors.CorruptLayer(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise errors.CorruptLayer(f"{what} is not a JSON object")
    return value


def _arch() -> str:
    machine = platform.machine()
    return _ARCH.get(machine, machine)


class _Blobs:
    """Blobs by digest in a layout: a directory or a tar file."""

    def __init__(self, name: str, read: Callable[[str], bytes], opener: Callable[[str], Opener]):
        self.name = name
        self._read = read
        self.opener = opener

    def json(self, digest: str, what: str) -> dict[str, Any]:
        return _json(_verified(self._read(digest), digest, what), what)


def _pick_manifest(blobs: _Blobs, index: dict[str, Any], tag: str | None) -> dict[str, Any]:
    manifests = [m for m in index.get("manifests") or () if isinstance(m, dict)]
    if tag is not None:
        named = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) == tag]
        if not named:
            raise errors.ImageNotFound(f"{blobs.name} has no image tagged {tag!r}")
        manifests = named
    if len(manifests) > 1:
        tags = sorted(str((m.get("annotations") or {}).get(REF_NAME)) for m in manifests)
        raise errors.ImageNotFound(
            f"{blobs.name} holds {len(manifests)} images ({', '.join(tags)}): name one as PATH:TAG"
        )
    if not manifests:
        raise errors.ImageNotFound(f"{blobs.name} holds no image")
    return manifests[0]


def _resolve_index(blobs: _Blobs, desc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Follow image indexes down to one manifest for this platform: (digest, manifest)."""
    for _ in range(4):
        digest = str(desc.get("digest"))
        doc = blobs.json(digest, f"the manifest {digest} of {blobs.name}")
        media = doc.get("mediaType") or desc.get("mediaType")
        if media in INDEX_TYPES or (media is None and "manifests" in doc):
            arch = _arch()
            for entry in doc.get("manifests") or ():
                plat = entry.get("platform") or {}
                if plat.get("os") == "linux" and plat.get("architecture") == arch:
                    desc = entry
                    break
            else:
                raise errors.ImageNotFound(f"{blobs.name} has no image for linux/{arch}")
            continue
        if media is not None and media not in MANIFEST_TYPES:
            raise errors.ImageError(f"{blobs.name}: unsupported manifest type {media!r}")
        return digest, doc
    raise errors.ImageError(f"{blobs.name}: image indexes nested too deep")


def _source(blobs: _Blobs, digest: str, manifest: dict[str, Any]) -> ImageSource:
    cdesc = manifest.get("config") or {}
    config_digest = str(cdesc.get("digest"))
    config = blobs.json(config_digest, f"the config of {blobs.name}")
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or ())
    descs = list(manifest.get("layers") or ())
    if len(diff_ids) != len(descs):
        raise errors.CorruptLayer(
            f"{blobs.name}: the manifest lists {len(descs)} layers, the config {len(diff_ids)}"
        )
    layers = []
    for desc, diff_id in zip(descs, diff_ids, strict=True):
        ldigest = str(desc.get("digest"))
        check_digest(ldigest, f"a layer of {blobs.name}")
        check_digest(str(diff_id), f"a layer of {blobs.name}")
        size = desc.get("size")
        size = size if isinstance(size, int) else None
        layers.append(Layer(ldigest, str(diff_id), size, blobs.opener(ldigest)))
    return ImageSource(digest, config_digest, config, tuple(layers))


# -- an OCI layout directory ----------------------------------------------------------------


def is_layout(path: Path) -> bool:
    return (path / "oci-layout").is_file() and (path / "index.json").is_file()


def read_layout(path: Path, tag: str | None = None) -> ImageSource:
    """The image of an OCI image layout directory (``skopeo copy ... oci:DIR``)."""
    name = f"the OCI layout {path}"

    def blob_path(digest: str) -> Path:
        return path / "blobs" / "sha256" / check_digest(digest, f"a blob of {name}")

    def read(digest: str) -> bytes:
        try:
            with open(blob_path(digest), "rb") as f:
                return f.read(_MAX_JSON)
        except FileNotFoundError:
            raise errors.ImageNotFound(f"{name} lacks the blob {digest}") from None

    def opener(digest: str) -> Opener:
        @contextmanager
        def open_blob() -> Iterator[IO[bytes]]:
            if not blob_path(digest).is_file():
                raise errors.ImageNotFound(f"{name} lacks the layer {digest}")
            with open(blob_path(digest), "rb") as f:
                yield f

        return open_blob

    blobs = _Blobs(name, read, opener)
    try:
        index = _json((path / "index.json").read_bytes()[:_MAX_JSON], f"{name}'s index.json")
    except FileNotFoundError:
        raise errors.ImageNotFound(f"{name} has no index.json") from None
    digest, manifest = _resolve_index(blobs, _pick_manifest(blobs, index, tag))
    return _source(blobs, digest, manifest)


# -- a tarball: an OCI archive or a docker save ---------------------------------------------


def read_archive(path: Path, tag: str | None = None) -> ImageSource:
    """The image of an OCI archive (a layout in a tar) or a ``docker save`` tarball."""
    name = f"the archive {path}"
    if not path.is_file():
        raise errors.ImageNotFound(f"no image at {path}")
    try:
        with tarfile.open(path) as tar:
            members = {os.path.normpath(m.name).lstrip("/"): m for m in tar.getmembers()}
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise errors.CorruptLayer(f"{name} is not a tar file, or a truncated one ({exc})") from None

    def member_opener(member_name: str, what: str) -> Opener:
        @contextmanager
        def open_member() -> Iterator[IO[bytes]]:
            member = members.get(member_name)
            if member is None or not member.isreg():
                raise errors.ImageNotFound(f"{name} lacks {what}")
            with tarfile.open(path) as t:
                f = t.extractfile(member)
                assert f is not None
                yield f

        return open_member

    def read_member(member_name: str, what: str) -> bytes:
        with member_opener(member_name, what)() as f:
            return f.read(_MAX_JSON)

    if "oci-layout" in members and "index.json" in members:
        blobs = _Blobs(
            name,
            lambda d: read_member(f"blobs/sha256/{check_digest(d, name)}", f"the blob {d}"),
            lambda d: member_opener(f"blobs/sha256/{check_digest(d, name)}", f"the layer {d}"),
        )
        index = _json(read_member("index.json", "index.json"), f"{name}'s index.json")
        digest, manifest = _resolve_index(blobs, _pick_manifest(blobs, index, tag))
        return _source(blobs, digest, manifest)
    if "manifest.json" not in members:
        raise errors.ImageNotFound(f"{name} is neither an OCI archive nor a docker save tarball")
    return _docker_save(name, tag, read_member, member_opener)


def _docker_save(
    name: str,
    tag: str | None,
    read_member: Callable[[str, str], bytes],
    member_opener: Callable[[str, str], Opener],
) -> ImageSource:
    try:
        entries = json.loads(read_member("manifest.json", "manifest.json"))
    except ValueError:
        raise errors.CorruptLayer(f"{name}'s manifest.json is not valid JSON") from None
    if not isinstance(entries, list):
        raise errors.CorruptLayer(f"{name}'s manifest.json is not a list")
    if tag is not None:
        entries = [
            e
            for e in entries
            if any(t == tag or t.endswith(":" + tag) for t in e.get("RepoTags") or ())
        ]
    if len(entries) != 1:
        tagged = f" tagged {tag!r}" if tag else ""
        hint = "; name one as PATH:TAG" if len(entries) > 1 else ""
        raise errors.ImageNotFound(f"{name} holds {len(entries)} images{tagged}{hint}")
    entry = entries[0]
    config_name = os.path.normpath(str(entry.get("Config")))
    config_bytes = read_member(config_name, "the image config")
    config_digest = sha256(config_bytes)
    stem = os.path.basename(config_name).removesuffix(".json")
    if len(stem) == 64 and "sha256:" + stem != config_digest:
        raise errors.DigestMismatch(f"the config of {name} does not match its digest {stem}")
    config = _json(config_bytes, f"the config of {name}")
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or ())
    paths = [os.path.normpath(str(p)) for p in entry.get("Layers") or ()]
    if len(paths) != len(diff_ids):
        raise errors.CorruptLayer(
            f"{name}: manifest.json lists {len(paths)} layers, the config {len(diff_ids)}"
        )
    layers = []
    for p, diff_id in zip(paths, diff_ids, strict=True):
        check_digest(str(diff_id), f"a layer of {name}")
        layers.append(Layer(None, str(diff_id), None, member_opener(p, f"the layer {p}")))
    return ImageSource(config_digest, config_digest, config, tuple(layers))
