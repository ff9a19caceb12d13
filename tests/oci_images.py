"""Small OCI images made by hand for the tests: layers as tar streams written entry by entry
(hostile ones too), an OCI image layout around them, a ``docker save`` tarball, and a
busybox root from Debian's busybox-static (``/bin/busybox`` and its applet links).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "ls", "cat", "echo", "id", "env", "pwd", "true", "false", "mkdir", "rm")


@dataclass
class Entry:
    """One tar entry: ``kind`` is file, dir, symlink, hardlink, fifo, chr or blk."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    size: int | None = None  # a header that claims another size (truncation, bombs)


def layer_tar(entries: Iterable[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode = e.mode
            info.mtime = 1_700_000_000
            payload: io.BytesIO | None = None
            if e.kind == "file":
                info.size = len(e.data)
                payload = io.BytesIO(e.data)
            elif e.kind == "dir":
                info.type = tarfile.DIRTYPE
                info.mode = e.mode if e.mode != 0o644 else 0o755
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.target
            elif e.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif e.kind in ("chr", "blk"):
                info.type = tarfile.CHRTYPE if e.kind == "chr" else tarfile.BLKTYPE
                info.devmajor, info.devminor = 1, 3
            tar.addfile(info, payload)
    return buf.getvalue()


def dir_tar(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return buf.getvalue()


def busybox_root(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "hello").write_text("hello from the image\n")
    return root


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Built:
    path: Path
    digest: str  # the manifest's
    layers: list[str]  # blob digests
    diff_ids: list[str]


def write_layout(
    path: Path,
    layers: list[bytes],
    *,
    config: dict[str, object] | None = None,
    compress: bool = True,
    tag: str = "latest",
    diff_ids: list[str] | None = None,
    blob_override: dict[int, bytes] | None = None,
) -> Built:
    """An OCI image layout at ``path`` holding one image of ``layers`` (plain tar bytes).
    ``blob_override`` replaces a layer's stored blob after its digest was computed (a
    corrupt download); ``diff_ids`` replaces the config's (a lying config)."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = sha(data)
        (blobs / digest.removeprefix("sha256:")).write_bytes(data)
        return digest

    descs, digests = [], []
    for i, tar in enumerate(layers):
        blob = gzip.compress(tar, mtime=0) if compress else tar
        digest = put(blob)
        if blob_override and i in blob_override:
            (blobs / digest.removeprefix("sha256:")).write_bytes(blob_override[i])
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else "")
        descs.append({"mediaType": media, "digest": digest, "size": len(blob)})
        digests.append(digest)
    ids = diff_ids if diff_ids is not None else [sha(t) for t in layers]
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "config": config if config is not None else {"Env": ["PATH=/bin"], "Cmd": ["sh"]},
        "rootfs": {"type": "layers", "diff_ids": ids},
    }
    cfg_bytes = json.dumps(cfg).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": put(cfg_bytes),
            "size": len(cfg_bytes),
        },
        "layers": descs,
    }
    man_bytes = json.dumps(manifest).encode()
    man_digest = put(man_bytes)
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": man_digest,
                "size": len(man_bytes),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (path / "index.json").write_text(json.dumps(index))
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return Built(path, man_digest, digests, ids)


def write_docker_save(path: Path, layers: list[bytes], repo_tag: str = "tiny:1") -> str:
    """A ``docker save`` tarball (the format before Docker 25): returns the image id."""
    ids = [sha(t) for t in layers]
    cfg = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin", "FROM_DOCKER=1"], "WorkingDir": "/etc"},
            "rootfs": {"type": "layers", "diff_ids": ids},
        }
    ).encode()
    image_id = sha(cfg)
    files = {f"{image_id.removeprefix('sha256:')}.json": cfg}
    names = []
    for i, tar in enumerate(layers):
        names.append(f"layer{i}/layer.tar")
        files[names[-1]] = tar
    config_name = f"{image_id.removeprefix('sha256:')}.json"
    files["manifest.json"] = json.dumps(
        [{"Config": config_name, "RepoTags": [repo_tag], "Layers": names}]
    ).encode()
    with tarfile.open(path, "w") as out:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return image_id


def tar_dir(src: Path, dest: Path) -> Path:
    """``tar -C src -cf dest .``: an OCI archive from a layout."""
    subprocess.run(["tar", "-C", str(src), "-cf", str(dest), "."], check=True)
    return dest


DPKG_TOOLS = ("/usr/bin/dpkg", "/usr/bin/dpkg-deb")


def dpkg_root(root: Path) -> Path:
    """A root with busybox and the host's dpkg (its libraries copied as ldd names them) and
    an empty package database, no Python: enough to install a .deb as box root. The caller
    skips when ``DPKG_TOOLS`` are missing."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in (*APPLETS, "grep", "tar", "diff", "ls", "cat"):
        if not (root / "bin" / applet).exists():
            (root / "bin" / applet).symlink_to("busybox")
    (root / "sbin").mkdir()
    for tool in ("ldconfig", "start-stop-daemon"):  # dpkg wants them on PATH
        (root / "sbin" / tool).symlink_to("/bin/true")
    (root / "usr" / "bin").mkdir(parents=True)
    for tool in DPKG_TOOLS:
        _copy_with_libs(root, tool)
    db = root / "var" / "lib" / "dpkg"
    for sub in ("info", "updates", "triggers", "alternatives"):
        (db / sub).mkdir(parents=True)
    (db / "status").write_text("")
    (root / "etc" / "dpkg").mkdir(parents=True)
    os.chmod(root, 0o755)
    return root


def make_deb(folder: Path, name: str = "corral-hello") -> Path:
    """``folder/NAME.deb``: a package installing ``/usr/bin/NAME``, which prints ``hello
    from a package``."""
    pkg = folder.parent / f"{folder.name}-{name}-pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: corral tests <t@example.invalid>\nDescription: a test package\n"
    )
    (pkg / "usr" / "bin").mkdir(parents=True)
    script = pkg / "usr" / "bin" / name
    script.write_text("#!/bin/sh\necho hello from a package\n")
    script.chmod(0o755)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(pkg), str(out)],
        check=True,
        capture_output=True,
    )
    return out


APT_TOOLS = (
    *DPKG_TOOLS,
    "/usr/bin/apt-get",
    "/usr/bin/dpkg-query",
    "/usr/bin/dpkg-split",
    "/usr/bin/tar",
    "/usr/lib/apt/methods/store",
    "/usr/lib/apt/methods/file",
    "/usr/lib/apt/methods/copy",
)


def _copy_with_libs(root: Path, tool: str) -> None:
    dest = root / tool.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(tool, dest)
    ldd = subprocess.run(["ldd", tool], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        words = line.split()
        lib = words[2] if "=>" in words and len(words) > 2 else (words[0] if words else "")
        target = root / lib.lstrip("/")
        if lib.startswith("/") and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), target)


def apt_root(root: Path) -> Path:
    """:func:`dpkg_root` with the host's apt-get (its local-file methods, GNU tar, dpkg's
    tables) and the ``_apt`` user it drops to: ``apt-get install ./x.deb`` works offline.
    The caller skips when ``APT_TOOLS`` are missing."""
    dpkg_root(root)
    (root / "bin" / "tar").unlink()  # dpkg-deb needs GNU tar's options
    for tool in APT_TOOLS:
        _copy_with_libs(root, tool)
    shutil.copytree("/usr/share/dpkg", root / "usr" / "share" / "dpkg")
    for sub in ("apt.conf.d", "preferences.d", "sources.list.d", "trusted.gpg.d"):
        (root / "etc" / "apt" / sub).mkdir(parents=True)
    (root / "etc" / "apt" / "sources.list").write_text("")
    for partial in ("var/lib/apt/lists/partial", "var/cache/apt/archives/partial"):
        (root / partial).mkdir(parents=True)
        os.chown(root / partial, 42, 0)  # _apt's, as in Debian
    (root / "var" / "log" / "apt").mkdir(parents=True)
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\n_apt:x:42:65534::/nonexistent:/bin/false\n"
    )
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return root
