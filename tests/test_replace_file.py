"""``state.replace_file``: the one way host code writes a small file whole (state records,
the passwd a box binds, mask records, image refs)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from corral.backends.host.state import replace_file


def test_the_file_is_replaced_whole_with_the_mode_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    path.write_text("old\n")
    held = path.open()  # a reader that opened the old file keeps reading the old file
    old = os.umask(0o077)
    try:
        replace_file(path, b"new\n" * 50_000, 0o644)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"new\n" * 50_000
    assert path.stat().st_mode & 0o777 == 0o644  # not narrowed by the umask
    assert held.read() == "old\n"
    held.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]


def test_a_planted_link_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "record.json"
    path.symlink_to(victim)
    replace_file(path, b"{}")
    assert victim.read_text() == "keep"
    assert not path.is_symlink() and path.read_bytes() == b"{}"
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    path.mkdir()
    (path / "inside").write_text("x")  # a directory in the way: the rename fails
    with pytest.raises(IsADirectoryError):
        replace_file(path, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_writers_at_once_each_land_whole(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    bodies = [bytes([65 + i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=replace_file, args=(path, body)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert path.read_bytes() in bodies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
