"""Lexical confinement of file-operation paths (pure)."""

from __future__ import annotations

import posixpath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral import PathOutsideSandbox, Policy
from corral.errors import ErrorCode, SandboxError
from corral.files import granted_roots, resolve

POLICY = Policy()


def test_relative_paths_are_taken_from_the_workspace() -> None:
    r = resolve("src/main.rs", POLICY, home="/root")
    assert (r.path, r.root) == ("/workspace/src/main.rs", "/workspace")


def test_dot_dot_inside_the_workspace_is_fine() -> None:
    assert resolve("a/../b", POLICY, home="/root").path == "/workspace/b"


@pytest.mark.parametrize("path", ["../etc/passwd", "a/../../x", "..", "./../../root"])
def test_climbing_out_of_the_workspace_is_refused(path: str) -> None:
    with pytest.raises(PathOutsideSandbox) as info:
        resolve(path, POLICY, home="/root")
    assert info.value.code == ErrorCode.PATH_OUTSIDE_SANDBOX


@pytest.mark.parametrize("path", ["/etc/passwd", "/", "/usr/bin/sh", "/workspace/../etc"])
def test_absolute_paths_outside_granted_roots_are_refused(path: str) -> None:
    with pytest.raises(PathOutsideSandbox):
        resolve(path, POLICY, home="/root")


@pytest.mark.parametrize("path", ["/etc/passwd", "/", "/usr/bin/sh", "/workspace/../etc"])
def test_reading_resolves_outside_paths_beneath_the_box_root(path: str) -> None:
    assert resolve(path, POLICY, home="/root", reading=True).root == "/"
    assert resolve("/workspace/x", POLICY, home="/root", reading=True).root == "/workspace"


@pytest.mark.parametrize("path", ["../etc/passwd", "/root/.ssh/id_rsa", "/etc/shadow"])
def test_reading_keeps_climbing_and_masks_refused(path: str) -> None:
    with pytest.raises(PathOutsideSandbox):
        resolve(path, POLICY, home="/root", reading=True)


def test_tmp_is_granted() -> None:
    assert resolve("/tmp/x", POLICY, home="/root").root == "/tmp"


def test_masked_path_inside_workspace_is_refused() -> None:
    policy = Policy.from_dict({"filesystem": {"deny_read": [".env"]}})
    with pytest.raises(PathOutsideSandbox, match="deny_read"):
        resolve(".env", policy, home="/root")


@pytest.mark.parametrize("path", ["", "a\x00b"])
def test_invalid_paths_are_input_errors(path: str) -> None:
    with pytest.raises(SandboxError) as info:
        resolve(path, POLICY, home="/root")
    assert info.value.code == ErrorCode.INVALID_INPUT


def test_mounts_are_granted_roots() -> None:
    policy = Policy.from_dict({"filesystem": {"mounts": [{"host": "/d", "guest": "/data"}]}})
    assert "/data" in granted_roots(policy, home="/root")
    assert resolve("/data/f", policy, home="/root").root == "/data"


segment = st.sampled_from(["a", "b", "..", ".", "", "/", "etc", "workspace", "tmp"])


@given(st.lists(segment, max_size=8), st.booleans())
def test_resolution_never_escapes_its_root(parts: list[str], absolute: bool) -> None:
    path = ("/" if absolute else "") + "/".join(parts)
    try:
        r = resolve(path, POLICY, home="/root")
    except SandboxError:
        return
    assert r.path == posixpath.normpath(r.path)
    assert r.path == r.root or r.path.startswith(r.root + "/")
    assert r.root in granted_roots(POLICY, home="/root")
