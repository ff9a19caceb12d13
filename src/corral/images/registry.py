"""Pulling images from an OCI registry, through skopeo.

Why skopeo (Debian's ``skopeo`` package) rather than a registry client of our own or a Python
library: the registry HTTP API is simple on the happy path but not around it (token auth
against a separate realm, ``~/.docker/config.json`` and ``containers-auth.json`` credentials,
mirrors and ``registries.conf``, manifest lists, Docker v2 schema conversion, retries, proxies).
skopeo is containers/image, the library podman, buildah and CRI-O use; it is packaged and
kept by Debian and writes a plain OCI layout that corral then reads with its own code. corral
does not trust it further than that: every blob skopeo writes is checked again against its
digest, and layers are unpacked by :mod:`corral.images.unpack`.

``skopeo copy docker://REF oci:DIR:TAG`` runs with ``--preserve-digests`` (a Docker-format
manifest is kept as the registry serves it, so the image's digest is the registry's; corral
reads both formats) and ``--insecure-policy`` (signature policy is
not corral's business: the digests are checked) and, for a registry on this machine
(``localhost``, ``127.0.0.0/8``, ``::1``), without TLS: that is what Docker does for such
registries, and what the tests' local registry needs.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from corral import errors

DEFAULT_REGISTRY = "docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_DOMAIN = re.compile(r"^(?:[a-zA-Z0-9.-]+|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$")


@dataclass(frozen=True)
class RegistryRef:
    domain: str
    path: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        text = f"{self.domain}/{self.path}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    @property
    def local(self) -> bool:
        """A registry on this machine (reached over plain HTTP, as Docker does)."""
        host = self.domain.rsplit(":", 1)[0] if not self.domain.endswith("]") else self.domain
        host = host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def parse_ref(ref: str) -> RegistryRef:
    """``name[:tag][@digest]`` in docker's spelling: ``busybox`` is
    ``docker.io/library/busybox:latest``; a first component with a dot, a colon or
    ``localhost`` is a registry host."""
    bad = errors.ImageError(
        f"{ref!r} is not an image reference (REGISTRY/NAME:TAG or NAME@sha256:DIGEST, "
        "or a path starting with / or ./)",
        code=errors.ErrorCode.INVALID_INPUT,
    )
    rest, _, digest = ref.partition("@")
    if digest and not _DIGEST.match(digest):
        raise bad
    domain, slash, remainder = rest.partition("/")
    is_host = "." in domain or ":" in domain or domain == "localhost" or domain.startswith("[")
    if slash and is_host:
        if not _DOMAIN.match(domain):
            raise bad
    else:
        domain, remainder = DEFAULT_REGISTRY, rest
    name, colon, tag = remainder.rpartition(":") if ":" in remainder else (remainder, "", "")
    if colon and not _TAG.match(tag):
        raise bad
    if not _NAME.match(name):
        raise bad
    if domain == DEFAULT_REGISTRY and "/" not in name:
        name = f"library/{name}"
    return RegistryRef(domain, name, tag or (None if digest else "latest"), digest or None)


def skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        raise errors.BackendUnavailable(
            "pulling from a registry needs skopeo (apt-get install skopeo; `make setup` does)"
        )
    return path


_NOT_FOUND = (
    "manifest unknown",
    "name unknown",
    "not found",
    "requested access to the resource is denied",
    "repository name not known",
)


def _verify(ref: RegistryRef, tls_verify: bool | None) -> str:
    return "true" if ((not ref.local) if tls_verify is None else tls_verify) else "false"


def manifest_digest(ref: RegistryRef, *, tls_verify: bool | None = None) -> str:
    """The digest of the manifest the registry serves for ``ref`` (one small request: a
    stored image with that digest needs no download)."""
    argv = [skopeo(), "inspect", "--raw", f"--tls-verify={_verify(ref, tls_verify)}"]
    proc = subprocess.run([*argv, f"docker://{ref}"], capture_output=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        _fail(ref, proc.returncode, proc.stderr.decode(errors="replace"))
    return "sha256:" + hashlib.sha256(proc.stdout).hexdigest()


def pull(ref: RegistryRef, dest: Path, *, tls_verify: bool | None = None) -> None:
    """Copy ``ref`` from its registry into an OCI layout at ``dest`` (tag ``image``)."""
    argv = [
        skopeo(),
        "--insecure-policy",
        "copy",
        "--quiet",
        "--preserve-digests",
        f"--src-tls-verify={_verify(ref, tls_verify)}",
        f"docker://{ref}",
        f"oci:{dest}:image",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        _fail(ref, proc.returncode, proc.stderr)


def _fail(ref: RegistryRef, status: int, stderr: str) -> NoReturn:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    reason = lines[-1] if lines else f"skopeo exited with {status}"
    reason = reason.removeprefix("time=").split('msg="', 1)[-1].rstrip('"')
    if "digest did not match" in reason.lower():
        raise errors.DigestMismatch(f"a blob of {ref} does not match its digest ({reason})")
    if any(marker in reason.lower() for marker in _NOT_FOUND):
        raise errors.ImageNotFound(f"no image {ref} in its registry ({reason})")
    raise errors.ImageError(f"pulling {ref} failed: {reason}")
