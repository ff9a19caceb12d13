"""The agent's user-space RESOLVE_BENEATH (gVisor before 2023 has no openat2): it must agree
with the kernel's openat2 on every path, symlink and ``..`` case, here on the host."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral.agent import files

# (path, flags) tried both ways; the tree is made by the fixture below.
CASES = [
    ("a/f", os.O_RDONLY),
    ("a/../a/f", os.O_RDONLY),
    ("a/./b/../f", os.O_RDONLY),
    ("link-to-a/f", os.O_RDONLY),
    ("a/link-to-f", os.O_RDONLY),
    ("a/link-up/a/f", os.O_RDONLY),
    ("a/link-out", os.O_RDONLY),
    ("a/link-out/x", os.O_RDONLY),
    ("a/link-abs", os.O_RDONLY),
    ("a/link-abs/x", os.O_RDONLY),
    ("a/loop", os.O_RDONLY),
    ("../x", os.O_RDONLY),
    ("a/../../x", os.O_RDONLY),
    ("a/f/x", os.O_RDONLY),
    ("a/missing", os.O_RDONLY),
    ("a/missing/x", os.O_RDONLY),
    ("a", os.O_RDONLY | os.O_DIRECTORY),
    ("a", os.O_PATH | os.O_DIRECTORY),
    (".", os.O_RDONLY | os.O_DIRECTORY),
    ("a/f", os.O_RDONLY | os.O_DIRECTORY),
    ("a/link-to-f", os.O_RDONLY | os.O_NOFOLLOW),
    ("a/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL),
    ("a/dangling", os.O_WRONLY | os.O_CREAT),
    ("a/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL),
]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[int]:
    top = tmp_path / "root"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "f").write_text("f")
    (tmp_path / "x").write_text("outside")
    os.symlink("a", top / "link-to-a")
    os.symlink("f", top / "a" / "link-to-f")
    os.symlink("..", top / "a" / "link-up")
    os.symlink("../..", top / "a" / "link-out")
    os.symlink(str(tmp_path), top / "a" / "link-abs")
    os.symlink("loop", top / "a" / "loop")
    os.symlink("made-by-dangling", top / "a" / "dangling")
    fd = os.open(top, os.O_PATH | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _outcome(
    opener: Callable[[int, str, int, int], int], root: int, path: str, flags: int
) -> object:
    try:
        fd = opener(root, path, flags, 0o644 if flags & os.O_CREAT else 0)
    except OSError as exc:
        return exc.errno
    try:
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


@pytest.mark.parametrize(("path", "flags"), CASES)
def test_user_space_resolution_agrees_with_openat2(root: int, path: str, flags: int) -> None:
    kernel = files._Openat2()
    want = _outcome(kernel.open, root, path, flags)
    created = [
        n for n in ("new", "made-by-dangling") if os.path.lexists(f"/proc/self/fd/{root}/a/{n}")
    ]
    for name in created:
        os.unlink(f"/proc/self/fd/{root}/a/{name}")
    got = _outcome(files.open_beneath, root, path, flags)
    if isinstance(want, tuple) and created:
        want = "created"
        got = "created" if isinstance(got, tuple) else got
    assert got == want


def test_the_fallback_is_taken_when_openat2_is_missing(root: int) -> None:
    opener = files._Openat2()
    opener.missing = True
    fd = opener.open(root, "link-to-a/f", os.O_RDONLY)
    try:
        assert os.read(fd, 10) == b"f"
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="outside the root"):
        opener.open(root, "a/link-out/x", os.O_RDONLY)
