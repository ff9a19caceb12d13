"""``corral image build`` from a Dockerfile subset (corral.images.build): FROM an image of the
store (or scratch), COPY from the context as layers, RUN in a corral box on the image so far
(its writable root's upper as the next layer), ENV/WORKDIR/USER/CMD into the config;
everything else refused with the line it is on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from corral import errors
from corral.cli import main
from corral.images import resolve_image
from corral.images.build import build
from corral.images.store import ImageStore
from oci_images import busybox_root, dir_tar, write_layout

pytestmark = pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="busybox-static")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ImageStore:
    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    return ImageStore()


@pytest.fixture
def base(tmp_path: Path) -> str:
    write_layout(tmp_path / "base", [dir_tar(busybox_root(tmp_path / "bb"))])
    return str(tmp_path / "base")


def test_build_copies_the_context_and_sets_the_config(
    store: ImageStore, base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "task" / "data").mkdir(parents=True)
    (ctx / "task" / "data" / "input.txt").write_text("42\n")
    (ctx / "task" / "run.sh").write_text("#!/bin/sh\ncat data/input.txt\n")
    os.chmod(ctx / "task" / "run.sh", 0o755)
    os.symlink("/etc/shadow", ctx / "task" / "link")  # copied as a link, never followed
    (ctx / "Dockerfile").write_text(
        f"# a task image\nFROM {base}\n"
        "ENV LANG=C.UTF-8 \\\n    TASK=demo\n"
        "WORKDIR /task\n"
        "COPY task/ .\n"
        "COPY Dockerfile /etc/\n"
        'CMD ["./run.sh"]\n'
        "USER 1000\n"
    )
    assert main(["image", "build", "-t", "task:1", str(ctx), "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["ref"] == "docker.io/library/task:1" and built["layers"] == 3
    image = resolve_image("task:1")  # stored: no pull
    assert image.config.env == {"PATH": "/bin", "LANG": "C.UTF-8", "TASK": "demo"}
    assert (image.config.workdir, image.config.user, image.config.cmd) == (
        "/task",
        "1000",
        ["./run.sh"],
    )
    assert image.rootfs is not None
    assert os.readlink(image.rootfs / "task" / "link") == "/etc/shadow"
    assert (image.rootfs / "task" / "run.sh").stat().st_mode & 0o777 == 0o755
    out = subprocess.run(
        ["bwrap", "--unshare-all", "--ro-bind", str(image.rootfs), "/", "--chdir", "/task",
         "/bin/sh", "-c", "./run.sh && cat /etc/Dockerfile | busybox head -1"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert out == "42\n# a task image\n"
    # The base's root is shared, not copied.
    base_record = store.resolve(base)
    assert base_record is not None
    busybox = {(store.rootfs(r) / "bin" / "busybox").stat().st_ino for r in (base_record,)}
    assert (image.rootfs / "bin" / "busybox").stat().st_ino in busybox


@pytest.mark.parametrize(
    ("dockerfile", "words"),
    [
        ("FROM scratch\nONBUILD RUN true\n", "line 2: ONBUILD is not in"),
        ("FROM scratch\nHEALTHCHECK NONE\n", "line 2: HEALTHCHECK is not in"),
        ("COPY a b\n", "line 1: the first instruction must be FROM"),
        ("FROM scratch\nCOPY ../secret /x\n", "leaves the build context"),
        ("FROM scratch\nCOPY /etc/passwd /x\n", "leaves the build context"),
        ("FROM scratch\nCOPY missing /x\n", "not in the build context"),
        ("FROM scratch\nFROM scratch\n", "one FROM only"),
        ("FROM scratch\nCMD [1]\n", "JSON list of strings"),
    ],
)
def test_build_refuses_what_it_does_not_do(
    store: ImageStore, tmp_path: Path, dockerfile: str, words: str
) -> None:
    with pytest.raises(errors.ImageError, match=words) as info:
        build(store, dockerfile, tmp_path, "x:1")
    assert info.value.code == errors.ErrorCode.INVALID_INPUT
    assert store.list() == []


def test_build_from_scratch(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "hello").write_text("hi\n")
    record = build(store, "FROM scratch\nCOPY hello /hello\n", tmp_path, "bare:1")
    assert os.listdir(store.rootfs(record)) == ["hello"]


needs_root_bwrap = [
    pytest.mark.needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="RUN boxes run on the bwrap backend as root"),
]


@pytest.mark.parametrize("_", [None], ids=["run"])
@needs_root_bwrap[0]
@needs_root_bwrap[1]
def test_run_steps_become_layers(
    store: ImageStore, base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], _: None
) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\n"
        "ENV GREETING=hi\n"
        "WORKDIR /app\n"  # not in the base: made by the first RUN, as Docker does
        "RUN echo built > out && id -u > uid && rm /etc/hello && mkdir -p /opt/x && "
        'echo "$GREETING" > /opt/x/g && mkdir /data && busybox chown 1000:1000 /data\n'
        "USER 1000\n"
        'RUN ["/bin/sh", "-c", "id -u > /data/who && echo says hello"]\n'
    )
    assert main(["image", "build", "-t", "ran:1", str(ctx), "--json"]) == 0
    captured = capsys.readouterr()
    built = json.loads(captured.out)
    assert built["layers"] == 3 and "says hello" in captured.err
    image = resolve_image("ran:1")
    root = image.rootfs
    assert root is not None
    assert (root / "app" / "out").read_text() == "built\n"
    assert (root / "app" / "uid").read_text() == "0\n"  # RUN is root unless USER says
    assert not (root / "etc" / "hello").exists()  # a deletion became a whiteout
    assert (root / "opt" / "x" / "g").read_text() == "hi\n"
    assert (root / "data" / "who").read_text() == "1000\n"
    # The layer records the box's ids (box root 0, the box user 1000), not host ids.
    assert (root / "app" / "out").stat().st_uid == 0
    assert (root / "data").stat().st_uid == 1000 and (root / "data" / "who").stat().st_uid == 1000
    refs = sorted(r.ref for r in store.list())
    assert len(refs) == 2 and "docker.io/library/ran:1" in refs  # the steps' images are gone
    assert (root / "bin" / "busybox").stat().st_ino == (
        store.rootfs(store.resolve(base)).joinpath("bin", "busybox").stat().st_ino  # type: ignore[arg-type]
    )


@needs_root_bwrap[0]
@needs_root_bwrap[1]
def test_a_failing_run_fails_the_build_with_its_output(
    store: ImageStore, base: str, tmp_path: Path
) -> None:
    dockerfile = f"FROM {base}\nRUN echo about to fail && exit 3\n"
    with pytest.raises(errors.ImageError, match=r"line 2: RUN exited with 3:\nabout to fail"):
        build(store, dockerfile, tmp_path, "bad:1")
    assert [r.ref for r in store.list()] == [store.resolve(base).ref]  # type: ignore[union-attr]


@needs_root_bwrap[0]
@needs_root_bwrap[1]
def test_run_boxes_take_the_builds_network_and_root_size(
    store: ImageStore, base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RUN has no network unless ``corral image build`` says (``--allow-port`` of a server
    on the host's 127.0.0.1 here), and its writable root is ``--root-size``."""
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    (served / "payload").write_text("fetched\n")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        ctx = tmp_path / "ctx"
        ctx.mkdir()
        fetch = f"RUN busybox wget -q -O /etc/payload http://127.0.0.1:{port}/payload\n"
        (ctx / "Dockerfile").write_text(f"FROM {base}\n{fetch}")
        argv = ["image", "build", "-t", "net:1", str(ctx), "--json"]
        assert main(argv) == 2  # no network by default
        assert "RUN exited with 1" in capsys.readouterr().out
        assert main([*argv, "--allow-port", str(port)]) == 0, capsys.readouterr()
        rootfs = resolve_image("net:1").rootfs
        assert rootfs is not None and (rootfs / "etc" / "payload").read_text() == "fetched\n"
    finally:
        server.shutdown()
        server.server_close()
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nRUN busybox dd if=/dev/zero of=/big bs=1M count=4\n"
    )
    status = main(["image", "build", "-t", "big:1", str(ctx), "--root-size", "2M", "--json"])
    out = capsys.readouterr().out  # ENOSPC on a tmpfs upper, EDQUOT on the cow store
    assert status == 2 and ("No space left on device" in out or "Disk quota exceeded" in out)


def test_a_workdir_the_image_lacks_is_made_as_docker_does(
    store: ImageStore, base: str, tmp_path: Path
) -> None:
    """WORKDIR without a RUN or COPY into it: the directories the image lacks become a
    layer (0755, root's); those it has keep their owner and mode, and a link is left as is."""
    dockerfile = f"FROM {base}\nWORKDIR /srv/app/data\n"
    record = build(store, dockerfile, tmp_path, "wd:1")
    root = store.rootfs(record)
    assert (root / "srv" / "app" / "data").is_dir() and len(record.layers) == 2
    assert (root / "srv").stat().st_mode & 0o777 == 0o755
    etc_mode = (root / "etc").stat().st_mode
    record = build(store, f"FROM {base}\nWORKDIR /etc\n", tmp_path, "wd:2")
    assert len(record.layers) == 1 and (store.rootfs(record) / "etc").stat().st_mode == etc_mode
