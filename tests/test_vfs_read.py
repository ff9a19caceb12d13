"""vfs_read of binary files returns base64 (not an empty string), with offset/limit for
large or partial reads; Files.read takes a byte range."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from corral import Sandbox
from corral.tools import Toolbox


async def test_binary_is_base64_and_ranges_work(tmp_path: Path) -> None:
    blob = os.urandom(100_000) + b"\x00"
    (tmp_path / "blob.bin").write_bytes(blob)
    (tmp_path / "text.txt").write_text("héllo wörld\n" * 3)
    async with Sandbox(workspace=tmp_path) as sb:
        assert await sb.files.read("blob.bin", offset=10, length=20) == blob[10:30]
        assert await sb.files.read("blob.bin", offset=len(blob) - 5, length=100) == blob[-5:]
        tools = Toolbox(sb)
        # Binary: base64, paged to fit the toolbox's output cap; the pages rebuild the file.
        got = b""
        while True:
            page = await tools.call("vfs_read", {"path": "blob.bin", "offset": len(got)})
            assert (page["binary"], page["encoding"], page["size"]) == (True, "base64", len(blob))
            assert "truncated" not in page
            got += base64.b64decode(page["content"])
            assert page["length"] > 0 and page["offset"] + page["length"] == len(got)
            if page["eof"]:
                break
        assert got == blob
        part = await tools.call("vfs_read", {"path": "blob.bin", "offset": 1000, "limit": 4096})
        assert base64.b64decode(part["content"]) == blob[1000:5096]
        assert (part["offset"], part["length"], part["eof"]) == (1000, 4096, False)
        tail = await tools.call("vfs_read", {"path": "blob.bin", "offset": len(blob) - 10})
        assert base64.b64decode(tail["content"]) == blob[-10:] and tail["eof"] is True
        text = await tools.call("vfs_read", {"path": "text.txt"})
        assert text["content"] == "héllo wörld\n" * 3 and text["encoding"] == "utf-8"
        # A range ending inside "é" (2 bytes) stops before it; length says so.
        cut = await tools.call("vfs_read", {"path": "text.txt", "limit": 2})
        assert (cut["content"], cut["length"], cut["eof"]) == ("h", 1, False)
        latin1 = tmp_path / "latin1.txt"
        latin1.write_bytes("café".encode("latin-1"))
        res = await tools.call("vfs_read", {"path": "latin1.txt"})
        assert res["encoding"] == "base64"
        assert base64.b64decode(res["content"]) == "café".encode("latin-1")
