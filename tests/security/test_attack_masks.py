"""Masks follow the host object from one box to the next (issue 13, class 3).

A box cannot move a masked object (the mask is a mount point) but it can rename a parent
(``mv secrets s2``): the next box's mask, laid out by path, found nothing there and the key
was readable at ``s2/key``. Hard links made by a box that saw a file before it was masked
were readable too. corral records the masked objects' (st_dev, st_ino) per writable area
and masks them where they are now (:mod:`corral.backends.host.maskfollow`)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from corral import Policy, PolicyError, Sandbox
from corral.backends.host import maskfollow
from corral.backends.layout import Place

pytestmark = [pytest.mark.attack("filesystem"), pytest.mark.needs_bwrap]

SECRET = "PRIVATE-KEY-MATERIAL"


@pytest.fixture(autouse=True)
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "data"
    monkeypatch.setenv("CORRAL_DATA_DIR", str(folder))
    return folder


def _with(policy: Policy, **fs: object) -> Policy:
    return policy.model_copy(update={"filesystem": policy.filesystem.model_copy(update=fs)})


async def _run(policy: Policy, workspace: Path, script: str) -> str:
    async with Sandbox(policy, workspace=workspace) as sb:
        r = await sb.run(["sh", "-c", script])
    return r.stdout + r.stderr


def _plant(workspace: Path) -> None:
    for rel in ("secrets/key", "deep/creds/id", ".config/gcloud/token", "hl/key2"):
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        (workspace / rel).write_text(f"{SECRET} {rel}\n")
    (workspace / "conf").mkdir()
    (workspace / "conf" / "settings").write_text("trusted\n")
    (workspace / "repo" / "hooks").mkdir(parents=True)
    (workspace / "repo" / "hooks" / "pre-commit").write_text("trusted\n")


async def test_masks_follow_objects_a_box_renamed_moved_or_linked(
    box_policy: Policy, workspace: Path
) -> None:
    """Box 0 (no masks yet) hard-links two files that are masked later; box 1 (masked)
    renames the parents of every masked path, moving one deeper; boxes 2 and 3 read every
    new name and write the deny_write file where it went: nothing readable, nothing written."""
    _plant(workspace)
    masked = _with(
        box_policy,
        deny_read=("secrets/key", "deep/creds", str(workspace / ".config" / "gcloud"), "hl/key2"),
        deny_write=("conf/settings", "repo"),
    )
    out = await _run(
        box_policy,
        workspace,
        "ln hl/key2 leak && ln deep/creds/id leak2 && ln conf/settings alias"
        " && ln repo/hooks/pre-commit hook && echo ok",
    )
    assert "ok" in out, out
    out = await _run(
        masked,
        workspace,
        "cat secrets/key; mv secrets s2 && mkdir -p x/y && mv deep x/y/ && mv .config cfg "
        "&& mv conf c2 && echo moved",
    )
    assert "moved" in out and SECRET not in out, out
    probe = "cat s2/key x/y/deep/creds/id cfg/gcloud/token leak leak2; ls x/y/deep/creds"
    out = await _run(
        masked,
        workspace,
        f"{probe}; echo evil >> c2/settings; echo evil >> alias; echo evil >> hook; mv s2 s3",
    )
    assert SECRET not in out, out
    assert "id" not in out.split(), out
    assert (workspace / "c2" / "settings").read_text() == "trusted\n"
    assert (workspace / "repo" / "hooks" / "pre-commit").read_text() == "trusted\n"
    out = await _run(masked, workspace, "cat s3/key leak; echo evil >> c2/settings")
    assert SECRET not in out, out
    assert (workspace / "c2" / "settings").read_text() == "trusted\n"


async def test_a_walk_past_its_bound_refuses_the_start(
    box_policy: Policy, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A moved object is searched for within a bound (entries, depth); past it the start
    is refused, naming the mask, never started without it."""
    _plant(workspace)
    masked = _with(box_policy, deny_read=("secrets/key",))
    out = await _run(masked, workspace, "mv secrets s2 && touch f1 f2 f3 f4 f5 f6 && echo ok")
    assert "ok" in out, out
    monkeypatch.setattr(maskfollow, "MAX_ENTRIES", 4)
    with pytest.raises(PolicyError, match="secrets/key") as info:
        async with Sandbox(masked, workspace=workspace):
            pass
    assert "4 directory entries" in info.value.message
    monkeypatch.setattr(maskfollow, "MAX_ENTRIES", 1000)
    monkeypatch.setattr(maskfollow, "MAX_DEPTH", 2)
    (workspace / "s2").rename(workspace / "f7")
    (workspace / "a" / "b" / "c").mkdir(parents=True)
    (workspace / "f7").rename(workspace / "a" / "b" / "c" / "s2")
    with pytest.raises(PolicyError, match="deeper than 2"):
        async with Sandbox(masked, workspace=workspace):
            pass


def test_an_object_gone_or_replaced_by_the_host_costs_no_walk(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A key the host rewrote in place (same parents, new inode) is the host's doing: no
    search. One a box moved and the host then deleted is forgotten, with a warning."""
    _plant(workspace)
    policy = Policy.from_dict({"filesystem": {"deny_read": ["secrets/key", "deep/creds"]}})
    assert maskfollow.locate(policy, workspace) == ({}, [])
    (workspace / "secrets" / "key").unlink()
    (workspace / "secrets" / "key").write_text("rotated\n")

    def no_walk(*args: object) -> None:
        raise AssertionError("walked")

    walk = maskfollow._walk
    monkeypatch.setattr(maskfollow, "_walk", no_walk)
    assert maskfollow.locate(policy, workspace) == ({}, [])
    monkeypatch.setattr(maskfollow, "_walk", walk)
    (workspace / "deep").rename(workspace / "d2")
    moved, _ = maskfollow.locate(policy, workspace)
    assert moved == {"deep/creds": (Place(0, "d2/creds", True),)}
    for name in os.listdir(workspace / "d2" / "creds"):
        (workspace / "d2" / "creds" / name).unlink()
    (workspace / "d2" / "creds").rmdir()
    with caplog.at_level(logging.WARNING):
        moved, warnings = maskfollow.locate(policy, workspace)
    assert moved == {} and "gone" in warnings[0], warnings


async def test_a_parent_renamed_while_the_box_starts_fails_closed(
    box_policy: Policy, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A box running at the same time on the workspace renames the masked key's parent
    after the host found the key and before the mask is mounted (made certain here: the
    rename runs right after the search): the mask lands on nothing, so the start fails."""
    _plant(workspace)
    locate = maskfollow.locate

    def then_rename(*args: Any, **kwargs: Any) -> Any:
        found = locate(*args, **kwargs)
        if (workspace / "secrets").exists():
            (workspace / "secrets").rename(workspace / "s2")
        return found

    monkeypatch.setattr(maskfollow, "locate", then_rename)
    with pytest.raises(PolicyError):
        async with Sandbox(_with(box_policy, deny_read=("secrets/key",)), workspace=workspace):
            pass


@pytest.mark.skipif(os.geteuid() != 0, reason="writable image roots run on bwrap as root")
async def test_a_snapshot_of_the_workspace_keeps_nothing_a_mask_hides(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``snapshot(workspace=True)`` copies the workspace on the host, as root: a masked
    key (by its path, renamed by an earlier box, hard-linked before it was masked) would
    reach every box restored from the snapshot, under any policy. It is left out."""
    from oci_images import busybox_root, dir_tar, write_layout

    monkeypatch.setenv("CORRAL_IMAGE_STORE", str(tmp_path / "store"))
    root = busybox_root(tmp_path / "rootfs")
    (root / "etc").mkdir(exist_ok=True)
    write_layout(tmp_path / "layout", [dir_tar(root)])
    image = str(tmp_path / "layout")
    _plant(workspace)
    plain = Policy(image=image, user="root")
    await _run(plain, workspace, "ln hl/key2 /workspace/leak && echo ok")
    masked = _with(plain, deny_read=("secrets/key", "deep/creds", ".config/gcloud", "hl/key2"))
    await _run(masked, workspace, "mv /workspace/deep /workspace/d2 && echo ok")
    async with Sandbox(masked, workspace=workspace) as sb:
        snap = await sb.snapshot("localhost/corral-test/masked:1", workspace=True)
    async with Sandbox.restore(snap, plain) as restored:
        r = await restored.run("cat -- $(find /workspace -type f) 2>&1; find /workspace")
    assert SECRET not in r.stdout, r.stdout
    assert "/workspace/conf/settings" in r.stdout  # the rest of the workspace is there


async def test_a_masked_object_moved_to_a_name_that_is_not_utf8_fails_closed(
    box_policy: Policy, workspace: Path
) -> None:
    """A name no OCI config can carry (runc and crun failed on the mangled path; gVisor
    laid the mask at another name and the key was readable): the start is refused."""
    _plant(workspace)
    masked = _with(box_policy, deny_read=("secrets/key",))
    out = await _run(masked, workspace, "mv secrets \"$(printf 'a\\377b')\" && echo ok")
    assert "ok" in out, out
    with pytest.raises(PolicyError, match="not UTF-8"):
        await _run(masked, workspace, "cat a*/key")


async def test_boxes_starting_at_once_on_one_workspace_all_mask(
    box_policy: Policy, workspace: Path
) -> None:
    """Each start records the masked objects: several at once on one workspace (an agent's
    parallel sessions) neither fail on each other's record nor leave the key open."""
    _plant(workspace)
    masked = _with(box_policy, deny_read=("secrets/key", "deep/creds"))
    outs = await asyncio.gather(*(_run(masked, workspace, "cat secrets/key") for _ in range(4)))
    assert all(SECRET not in out for out in outs), outs


@pytest.mark.parametrize("field", ["deny_read", "deny_write"])
def test_a_mask_written_as_a_glob_is_refused_not_skipped(field: str) -> None:
    """``secrets/*.pem`` was taken as a literal path that does not exist: nothing was
    masked, silently. Refused, naming the entry."""
    with pytest.raises(PolicyError, match=r"secrets/\*\.pem"):
        Policy.from_dict({"filesystem": {field: ["secrets/*.pem"]}})


def test_records_never_lie_where_the_box_writes(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rootless box with workspace = $HOME could edit ``~/.local/share/corral/masks`` and
    make the next start forget what moved: records inside a writable area are kept in the
    state root instead."""
    _plant(workspace)
    monkeypatch.setenv("CORRAL_DATA_DIR", str(workspace / "data"))
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    policy = Policy.from_dict({"filesystem": {"deny_read": ["secrets/key"]}})
    maskfollow.locate(policy, workspace)
    assert not (workspace / "data").exists()
    assert list((tmp_path / "state" / "masks").glob("*.json"))
    (workspace / "secrets").rename(workspace / "s2")
    moved, _ = maskfollow.locate(policy, workspace)
    assert moved == {"secrets/key": (Place(0, "s2/key", False),)}


async def test_the_default_credential_masks_follow_with_workspace_home(
    box_policy: Policy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workspace = ``$HOME`` with corral's default masks: ``~/.config/gcloud`` after box 1
    renamed ``.config``, and ``~/.ssh`` (a mount point right below the workspace: the box
    cannot rename it), stay unreadable in box 2."""
    home = tmp_path / "home"
    (home / ".config" / "gcloud").mkdir(parents=True)
    (home / ".config" / "gcloud" / "token").write_text(f"{SECRET} gcloud\n")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text(f"{SECRET} ssh\n")
    monkeypatch.setenv("HOME", str(home))

    async def run(script: str) -> str:
        async with Sandbox(box_policy, workspace=home, allow_dangerous_workspace=True) as sb:
            r = await sb.run(["sh", "-c", script])
        return r.stdout + r.stderr

    out = await run("mv .config c2; mv .ssh s2; mkdir -p a/b && mv c2 a/b/; echo ok")
    assert "ok" in out and SECRET not in out, out
    out = await run("cat a/b/c2/gcloud/token s2/id_ed25519 .ssh/id_ed25519 .config/gcloud/token")
    assert SECRET not in out, out


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches a mode 000 directory anyway")
def test_a_directory_the_walk_cannot_search_refuses_the_start(workspace: Path) -> None:
    """Rootless, the box's commands are the user: a box could move the key into a mode 000
    directory, which the user's own walk cannot read. Refused, never taken as gone."""
    _plant(workspace)
    policy = Policy.from_dict({"filesystem": {"deny_read": ["secrets/key"]}})
    maskfollow.locate(policy, workspace)
    (workspace / "hide").mkdir()
    (workspace / "secrets").rename(workspace / "hide" / "s2")
    (workspace / "hide").chmod(0)
    try:
        with pytest.raises(PolicyError, match="cannot search 'hide'"):
            maskfollow.locate(policy, workspace)
    finally:
        (workspace / "hide").chmod(0o755)
