"""Pulling through a real registry on 127.0.0.1 (Debian's docker-registry, started once per
session): images built here are pushed with skopeo and pulled back through ``corral image``
and :func:`corral.images.resolve_image`; unknown images, corrupt blobs and hostile layers
served by the registry end in a clear error with nothing left in the store.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import backend_skip
from corral.cli import main
from corral.images import resolve_image
from corral.images.store import ImageStore
from local_registry import Registry, available, running_registry
from oci_images import (
    APT_TOOLS,
    Entry,
    apt_root,
    busybox_root,
    dir_tar,
    layer_tar,
    make_deb,
    write_layout,
)

pytestmark = pytest.mark.skipif(
    not available() or not Path("/bin/busybox").exists(),
    reason="needs docker-registry, skopeo and busybox-static (make setup)",
)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="session")
def busybox_tar(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return dir_tar(busybox_root(tmp_path_factory.mktemp("bb") / "root"))


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ImageStore:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    return ImageStore()


def corral(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    status = main(["image", *argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out)


def assert_empty(store: ImageStore) -> None:
    assert list((store.root / "tmp").iterdir()) == []
    assert list((store.root / "roots").iterdir()) == []
    assert store.list() == []


def test_pull_ls_inspect_rm_through_a_local_registry(
    registry: Registry,
    store: ImageStore,
    tmp_path: Path,
    busybox_tar: bytes,
    capsys: pytest.CaptureFixture[str],
) -> None:
    built = write_layout(
        tmp_path / "bb", [busybox_tar], config={"Env": ["PATH=/bin"], "WorkingDir": "/etc"}
    )
    ref = registry.push(tmp_path / "bb", "busybox:1")
    status, pulled = corral(capsys, "pull", ref)
    assert status == 0
    assert isinstance(pulled, dict)
    assert pulled["ref"] == ref and pulled["digest"] == built.digest
    assert pulled["source"] == "registry" and pulled["layers"] == 1

    status, listed = corral(capsys, "ls")
    assert [row["ref"] for row in listed] == [ref]
    status, info = corral(capsys, "inspect", built.digest[:19])
    assert isinstance(info, dict)
    assert info["config"] == {"Env": ["PATH=/bin"], "WorkingDir": "/etc"}
    assert info["layers"] == built.diff_ids

    # A box's view: the image's own busybox as /, no Python anywhere in it.
    image = resolve_image(ref)  # stored: no second pull
    assert image.rootfs == Path(pulled["rootfs"]) and image.config.workdir == "/etc"
    out = subprocess.run(
        [
            "bwrap",
            "--unshare-all",
            "--ro-bind",
            str(image.rootfs),
            "/",
            "/bin/sh",
            "-c",
            "cat /etc/hello; test -e /usr/bin/python3 || echo no python",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out == "hello from the image\nno python\n"

    # Pinned by digest: the same layers, nothing unpacked again.
    status, pinned = corral(capsys, "pull", f"{registry.host}/busybox@{built.digest}")
    assert status == 0 and pinned["rootfs"] == pulled["rootfs"]

    status, removed = corral(capsys, "rm", ref, f"{registry.host}/busybox@{built.digest}")
    assert status == 0 and len(removed["removed"]) == 2
    assert_empty(store)


def test_a_docker_format_image_keeps_the_registrys_digest(
    registry: Registry, store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    own = layer_tar([Entry("etc/docker-format", data=b"v2s2")])  # this test's alone
    built = write_layout(tmp_path / "bb", [busybox_tar, own])
    ref = registry.push(tmp_path / "bb", "docker-format:1", fmt="v2s2")
    served = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
        capture_output=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert b"application/vnd.docker.distribution.manifest.v2+json" in served
    record = store.pull(ref)
    assert record.digest == "sha256:" + hashlib.sha256(served).hexdigest()
    assert (store.rootfs(record) / "etc" / "hello").read_text() == "hello from the image\n"
    # Pulled again (by digest): the manifest is known, no layer is downloaded (the registry's
    # copy of the layer, broken now, is never read).
    registry.blob_path(built.layers[1]).write_bytes(b"broken")
    pinned = store.pull(f"{registry.host}/docker-format@{record.digest}")
    assert pinned.digest == record.digest and pinned.chain == record.chain


def test_resolve_image_pulls_what_is_not_stored(
    registry: Registry, store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    write_layout(tmp_path / "bb", [busybox_tar, layer_tar([Entry("etc/extra", data=b"2")])])
    ref = registry.push(tmp_path / "bb", "two-layers:latest")
    image = resolve_image(ref)
    assert image.rootfs is not None and (image.rootfs / "etc" / "extra").read_text() == "2"
    assert len(list((store.root / "roots").iterdir())) == 2


def test_an_unknown_image_is_a_clear_error(
    registry: Registry, store: ImageStore, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = corral(capsys, "pull", f"{registry.host}/no-such-image:1")
    assert status == 125
    assert err["error"]["code"] == "image_not_found"
    assert "no-such-image" in err["error"]["message"]
    status, err = corral(capsys, "inspect", "nothing-here")
    assert err["error"]["code"] == "image_not_found"
    status, err = corral(capsys, "pull", "UPPER/case!")
    assert status == 2 and err["error"]["code"] == "invalid_input"


def test_a_corrupt_blob_in_the_registry_is_refused(
    registry: Registry,
    store: ImageStore,
    tmp_path: Path,
    busybox_tar: bytes,
    capsys: pytest.CaptureFixture[str],
) -> None:
    built = write_layout(tmp_path / "bb", [busybox_tar, layer_tar([Entry("x", data=b"x")])])
    ref = registry.push(tmp_path / "bb", "corrupt:1")
    blob = registry.blob_path(built.layers[1])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    status, err = corral(capsys, "pull", ref)
    assert status == 125
    assert err["error"]["code"] == "digest_mismatch", err
    assert_empty(store)


def test_a_hostile_layer_from_the_registry_leaves_nothing(
    registry: Registry,
    store: ImageStore,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hostile = layer_tar([Entry("etc", "symlink", target="/etc"), Entry("etc/cron.d/x", data=b"")])
    write_layout(tmp_path / "evil", [hostile])
    ref = registry.push(tmp_path / "evil", "evil:1")
    status, err = corral(capsys, "pull", ref)
    assert status == 125
    assert err["error"]["code"] == "unsafe_layer"
    assert "through a symlink" in err["error"]["message"]
    assert not Path("/etc/cron.d/x").exists()
    assert_empty(store)


@pytest.mark.skipif(os.geteuid() != 0, reason="images run on the bwrap and oci backends as root")
@pytest.mark.parametrize("backend", ["bwrap", "oci-runc"])
def test_pull_run_and_install_as_box_root_from_a_local_registry(
    registry: Registry, store: ImageStore, tmp_path: Path, backend: str
) -> None:
    """The issue's path end to end through ``corral run``: an image without Python pulled
    from the registry runs its Cmd; box root installs a package with apt-get on its writable
    root (apt dropping to _apt as it does); the stored image and the host are unchanged."""
    if not all(os.path.exists(t) for t in APT_TOOLS):
        pytest.skip("apt and dpkg are not installed")
    if backend_skip(backend):
        pytest.skip(str(backend_skip(backend)))
    chosen = ["--backend", "oci", "--runtime", backend.removeprefix("oci-")]
    config: dict[str, object] = {
        "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        "Cmd": ["sh", "-c", "command -v python3 || echo no-python"],
    }
    write_layout(tmp_path / "layout", [dir_tar(apt_root(tmp_path / "root"))], config=config)
    ref = registry.push(tmp_path / "layout", "dpkg:1")
    deb = make_deb(tmp_path / "ws")
    env = {**os.environ, "CORRAL_IMAGE_STORE": str(store.root)}
    argv = [sys.executable, "-m", "corral.cli", "run", "--workspace", str(deb.parent)]
    if backend != "bwrap":
        argv += chosen
    cmd = subprocess.run(
        [*argv, "--image", ref], capture_output=True, text=True, timeout=120, env=env
    )
    assert cmd.returncode == 0 and cmd.stdout == "no-python\n", cmd
    install = "apt-get install -y ./corral-hello.deb > /dev/null && corral-hello"
    r = subprocess.run(
        [*argv, "--image", ref, "--user", "root", "--", "sh", "-c", install],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0 and r.stdout == "hello from a package\n", r
    rootfs = resolve_image(ref).rootfs
    assert rootfs is not None and not (rootfs / "usr" / "bin" / "corral-hello").exists()
    assert (rootfs / "var" / "lib" / "dpkg" / "status").read_text() == ""
    assert not Path("/usr/bin/corral-hello").exists()
