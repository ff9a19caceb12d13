"""The image store: OCI layouts, OCI archives and docker save tarballs unpacked into a cache
by layer chain, with whiteouts and hard links, shared between images; hostile layers end in
a clear error and leave nothing half-unpacked (corral.images.store, corral.images.unpack).

The images are made here, by hand (tests/oci_images.py): a busybox root from Debian's
busybox-static, and layers written entry by entry. A root is checked by running its busybox
in bwrap with the root as ``/`` (no Python in it).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from corral import errors
from corral.images import resolve_image
from corral.images.store import ImageStore
from corral.images.unpack import Limits
from oci_images import (
    Entry,
    busybox_root,
    dir_tar,
    layer_tar,
    tar_dir,
    write_docker_save,
    write_layout,
)

pytestmark = pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="busybox-static")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture(scope="module")
def busybox_tar(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return dir_tar(busybox_root(tmp_path_factory.mktemp("bb") / "root"))


def in_root(rootfs: Path, script: str) -> str:
    """Run ``sh -c script`` with ``rootfs`` as ``/`` (read-only): the image's own busybox."""
    proc = subprocess.run(
        ["bwrap", "--unshare-all", "--ro-bind", str(rootfs), "/", "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def assert_clean(store: ImageStore, roots: int) -> None:
    """Nothing half-unpacked: no work in progress, only complete roots."""
    assert list((store.root / "tmp").iterdir()) == []
    assert len(list((store.root / "roots").iterdir())) == roots


def test_an_oci_layout_unpacks_into_a_root_that_runs(
    store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    built = write_layout(tmp_path / "bb", [busybox_tar])
    record = store.resolve(str(tmp_path / "bb"))
    assert record is not None
    assert record.digest == built.digest and record.source == "oci-layout"
    rootfs = store.rootfs(record)
    assert in_root(rootfs, "cat /etc/hello; busybox wc -l /etc/passwd") == (
        "hello from the image\n1 /etc/passwd\n"
    )
    # Read again: the layout's layers are stored, nothing is unpacked twice.
    mtime = rootfs.stat().st_mtime_ns
    assert store.resolve(str(tmp_path / "bb")) == record
    assert rootfs.stat().st_mtime_ns == mtime
    assert_clean(store, 1)


def test_layers_apply_whiteouts_opaque_dirs_hard_links_and_replacements(
    store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    lower = layer_tar(
        [
            Entry("etc/gone", data=b"old"),
            Entry("opt", "dir"),
            Entry("opt/old", data=b"lower"),
            Entry("opt/sub", "dir"),
            Entry("opt/sub/deep", data=b"lower"),
            Entry("var/was-a-dir", "dir"),
            Entry("var/was-a-dir/x", data=b"x"),
            Entry("abs", "symlink", target="/etc/passwd"),
        ]
    )
    upper = layer_tar(
        [
            Entry("opt/kept", data=b"upper"),  # before the opaque marker: stays
            Entry("opt/.wh..wh..opq"),
            Entry("etc/.wh.gone"),
            Entry("var/was-a-dir", data=b"now a file"),
            Entry("bin/ash", "hardlink", target="bin/busybox"),
            Entry("suid", data=b"#", mode=0o4755),
            Entry("fifo", "fifo"),
            Entry("dev", "dir"),
            Entry("dev/null", "chr"),  # as in an mmdebstrap tarball: skipped, never made
        ]
    )
    write_layout(tmp_path / "img", [busybox_tar, lower, upper])
    record = store.resolve(str(tmp_path / "img"))
    assert record is not None
    rootfs = store.rootfs(record)
    assert sorted(os.listdir(rootfs / "opt")) == ["kept"]
    assert not (rootfs / "etc" / "gone").exists()
    assert (rootfs / "var" / "was-a-dir").read_text() == "now a file"
    assert os.readlink(rootfs / "abs") == "/etc/passwd"  # kept, never followed on the host
    busybox = (rootfs / "bin" / "busybox").stat()
    assert (rootfs / "bin" / "ash").stat().st_ino == busybox.st_ino
    assert (rootfs / "suid").stat().st_mode & 0o7777 == 0o755  # setuid dropped
    assert (rootfs / "fifo").is_fifo()
    assert os.listdir(rootfs / "dev") == []
    assert in_root(rootfs, "cat /abs; /bin/ash -c 'echo linked'") == (
        "root:x:0:0:root:/root:/bin/sh\nlinked\n"
    )
    assert_clean(store, 3)  # one root per layer chain


def test_images_share_their_common_layers(
    store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    a = layer_tar([Entry("a", data=b"a")])
    b = layer_tar([Entry("b", data=b"b")])
    write_layout(tmp_path / "a", [busybox_tar, a])
    write_layout(tmp_path / "b", [busybox_tar, b])
    ra, rb = store.resolve(str(tmp_path / "a")), store.resolve(str(tmp_path / "b"))
    assert ra is not None and rb is not None
    assert_clean(store, 3)  # the busybox layer once, and each image's top
    ino = {(store.rootfs(r) / "bin" / "busybox").stat().st_ino for r in (ra, rb)}
    assert len(ino) == 1  # the same file, not a copy
    assert not (store.rootfs(ra) / "b").exists() and not (store.rootfs(rb) / "a").exists()
    # rm keeps what another image still uses, then drops the rest.
    store.remove(ra.ref)
    assert_clean(store, 2)
    assert (store.rootfs(rb) / "b").read_text() == "b"
    store.remove(rb.digest[:19])  # by a digest prefix, as docker
    assert_clean(store, 0)
    assert store.list() == []


def test_a_docker_save_tarball_and_an_oci_archive(
    store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    image_id = write_docker_save(tmp_path / "saved.tar", [busybox_tar], repo_tag="tiny:1")
    record = store.resolve(f"{tmp_path}/saved.tar:1")
    assert record is not None and record.digest == image_id and record.source == "archive"
    assert in_root(store.rootfs(record), "cat /etc/hello") == "hello from the image\n"

    built = write_layout(tmp_path / "layout", [busybox_tar], tag="v2")
    archive = tar_dir(tmp_path / "layout", tmp_path / "oci.tar")
    record = store.resolve(str(archive))
    assert record is not None and record.digest == built.digest
    assert_clean(store, 1)  # the same layer as the docker save's


def test_resolve_image_gives_the_root_and_the_config(
    tmp_path: Path, busybox_tar: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    config: dict[str, object] = {
        "Env": ["PATH=/bin", "GREETING=hi=there"],
        "WorkingDir": "/etc",
        "User": "1000",
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["echo hi"],
    }
    built = write_layout(tmp_path / "bb", [busybox_tar], config=config)
    image = resolve_image(str(tmp_path / "bb"))
    assert image.rootfs is not None and (image.rootfs / "bin" / "busybox").is_file()
    assert image.config.env == {"PATH": "/bin", "GREETING": "hi=there"}
    assert (image.config.workdir, image.config.user) == ("/etc", "1000")
    assert image.config.cmd == ["/bin/sh", "-c", "echo hi"]
    assert image.config.digest == built.digest
    assert resolve_image("host").rootfs is None
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve_image(str(plain)).rootfs == plain
    with pytest.raises(errors.ImageNotFound):
        resolve_image(str(tmp_path / "missing"))


# -- hostile and broken layers: a clear error, nothing left behind ------------------------


HOSTILE = {
    "dotdot": ([Entry("../escape", data=b"x")], errors.UnsafeLayer, "leaves the image root"),
    "dotdot-inside": ([Entry("a/../../escape", data=b"x")], errors.UnsafeLayer, "leaves"),
    "through-absolute-symlink": (
        [Entry("etc2", "symlink", target="/etc"), Entry("etc2/evil", data=b"x")],
        errors.UnsafeLayer,
        "through a symlink",
    ),
    "through-relative-symlink": (
        [Entry("up", "symlink", target="../../.."), Entry("up/evil", data=b"x")],
        errors.UnsafeLayer,
        "through a symlink",
    ),
    "hardlink-outside": (
        [Entry("pw", "hardlink", target="../../../etc/passwd")],
        errors.UnsafeLayer,
        "leaves the image root",
    ),
    "hardlink-through-symlink": (
        [Entry("e", "symlink", target="/etc"), Entry("pw", "hardlink", target="e/passwd")],
        errors.UnsafeLayer,
        "through a symlink",
    ),
    "hardlink-to-nothing": (
        [Entry("pw", "hardlink", target="no/such")],
        errors.UnsafeLayer,
        "names no file",
    ),
    "char-device": ([Entry("usr/mem", "chr")], errors.UnsafeLayer, "device node"),
    "block-device": ([Entry("sda", "blk")], errors.UnsafeLayer, "device node"),
    "bad-whiteout": ([Entry(".wh..")], errors.UnsafeLayer, "whiteout"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_layer_is_refused_and_leaves_nothing(
    case: str, store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    entries, error, words = HOSTILE[case]
    outside = tmp_path / "escape"
    write_layout(tmp_path / "img", [busybox_tar, layer_tar(entries)])
    with pytest.raises(error, match=words) as info:
        store.resolve(str(tmp_path / "img"))
    assert info.value.code == error.code
    assert not outside.exists()
    assert_clean(store, 1)  # the good busybox layer below, complete; nothing of the bad one
    assert store.list() == []


def test_a_tarball_bomb_stops_at_the_caps(tmp_path: Path, busybox_tar: bytes) -> None:
    store = ImageStore(tmp_path / "store", Limits(max_bytes=4 << 20, max_entries=50))
    big = layer_tar([Entry("zeros", data=bytes(16 << 20))])  # 16 MiB, gzips to ~16 KiB
    write_layout(tmp_path / "bytes", [big])
    with pytest.raises(errors.ImageTooLarge, match="more than 4194304 bytes"):
        store.resolve(str(tmp_path / "bytes"))
    many = layer_tar([Entry(f"f{i}") for i in range(100)])
    write_layout(tmp_path / "entries", [many])
    with pytest.raises(errors.ImageTooLarge, match="more than 50 entries"):
        store.resolve(str(tmp_path / "entries"))
    assert_clean(store, 0)


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_a_header_bomb_is_refused_before_it_is_read(
    kind: bytes, store: ImageStore, tmp_path: Path
) -> None:
    """A PAX or GNU long-name header claiming 1 GiB: tarfile would read it into memory."""
    info = tarfile.TarInfo("header")
    info.type, info.size = kind, 1 << 30
    bomb = info.tobuf(
        format=tarfile.USTAR_FORMAT if kind == tarfile.XHDTYPE else tarfile.GNU_FORMAT
    )
    write_layout(tmp_path / "img", [bomb + bytes(4096)])
    with pytest.raises(errors.ImageTooLarge, match="1073741824-byte tar header"):
        store.resolve(str(tmp_path / "img"))
    assert_clean(store, 0)


def test_a_truncated_or_swapped_layer_or_a_lying_config(
    store: ImageStore, tmp_path: Path, busybox_tar: bytes
) -> None:
    good = gzip.compress(busybox_tar, mtime=0)
    write_layout(tmp_path / "cut", [busybox_tar], blob_override={0: good[: len(good) // 2]})
    with pytest.raises(errors.CorruptLayer, match="truncated"):
        store.resolve(str(tmp_path / "cut"))
    other = gzip.compress(layer_tar([Entry("x", data=b"x")]))
    write_layout(tmp_path / "swapped", [busybox_tar], blob_override={0: other})
    with pytest.raises(errors.DigestMismatch, match="hashes to"):
        store.resolve(str(tmp_path / "swapped"))
    lying = "sha256:" + "0" * 64
    write_layout(tmp_path / "lying", [busybox_tar], diff_ids=[lying])
    with pytest.raises(errors.DigestMismatch, match="diff id"):
        store.resolve(str(tmp_path / "lying"))
    garbage = b"\x1f\x8b" + os.urandom(1000)
    write_layout(tmp_path / "garbage", [busybox_tar], blob_override={0: garbage})
    with pytest.raises(errors.CorruptLayer):
        store.resolve(str(tmp_path / "garbage"))
    assert_clean(store, 0)
    assert store.list() == []


def test_a_tampered_manifest_and_a_missing_tag(store: ImageStore, tmp_path: Path) -> None:
    built = write_layout(tmp_path / "img", [layer_tar([Entry("a", data=b"a")])], tag="v1")
    with pytest.raises(errors.ImageNotFound, match="no image tagged 'v2'"):
        store.resolve(f"{tmp_path}/img:v2")
    assert store.resolve(f"{tmp_path}/img:v1") is not None
    blob = tmp_path / "img" / "blobs" / "sha256" / built.digest.removeprefix("sha256:")
    manifest = json.loads(blob.read_text())
    manifest["annotations"] = {"tampered": "yes"}
    blob.write_text(json.dumps(manifest))
    with pytest.raises(errors.DigestMismatch, match="does not match its digest"):
        store.resolve(f"{tmp_path}/img:v1")


def test_a_crashed_writers_work_is_swept(store: ImageStore, tmp_path: Path) -> None:
    write_layout(tmp_path / "img", [layer_tar([Entry("a", data=b"a")])])
    (store.root / "tmp" / "999999999-dead" / "root" / "half").mkdir(parents=True)
    assert store.resolve(str(tmp_path / "img")) is not None
    assert_clean(store, 1)


def test_concurrent_imports_of_one_image_agree(tmp_path: Path, busybox_tar: bytes) -> None:
    """Three processes import the same image at once: one unpacks (the store's lock), the
    others find it done; one root, nothing left in tmp/."""
    write_layout(tmp_path / "img", [busybox_tar, layer_tar([Entry("a", data=b"a")])])
    code = (
        "import sys; from corral.images.store import ImageStore; "
        "s = ImageStore(sys.argv[1]); print(s.rootfs(s.resolve(sys.argv[2])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "store"), str(tmp_path / "img")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(outs) == 1
    assert_clean(ImageStore(tmp_path / "store"), 2)


def test_the_cli_on_local_images(
    tmp_path: Path,
    busybox_tar: bytes,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from corral.cli import main

    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    built = write_layout(tmp_path / "bb", [busybox_tar], tag="v1")
    assert main(["image", "pull", "./bb:v1"]) == 0
    ref = f"oci-layout:{tmp_path}/bb:v1"
    assert capsys.readouterr().out == f"{ref} {built.digest}\n"
    assert main(["image", "ls"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["REF", "DIGEST", "LAYERS", "SIZE", "SOURCE"]
    assert row.split()[:3] == [ref, built.digest[7:19], "1"] and row.endswith("oci-layout")
    assert main(["image", "inspect", "./bb:v1"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == built.digest
    (tmp_path / "plain").mkdir()
    assert main(["image", "pull", "./plain"]) == 2
    assert "no OCI image layout" in capsys.readouterr().err
    assert main(["image", "rm", "./bb:v1", "nothing"]) == 125  # all or none
    assert "[image_not_found] no image 'nothing'" in capsys.readouterr().err
    assert main(["image", "rm", "./bb:v1"]) == 0
    assert capsys.readouterr().out == f"removed {ref}\n"
    assert main(["image", "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_resolve_root_is_what_a_backend_mounts(tmp_path: Path) -> None:
    """``resolve_root``: no root of its own for the host's system, a plain directory as it
    is (the one check every backend made before mounting an image's root)."""
    from corral.images import resolve_root

    assert resolve_root("host") is None
    (tmp_path / "root" / "bin").mkdir(parents=True)
    found = resolve_root(str(tmp_path / "root"))
    assert found is not None and found.rootfs == (tmp_path / "root").resolve()
