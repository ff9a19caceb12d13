"""``Policy -> bwrap argv`` is pure: these tests run no process."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral import Mount, Policy, PolicyError
from corral.backends.bwrap import args as bwrap_args
from corral.backends.bwrap.args import BwrapFds, BwrapInputs, bwrap_argv
from corral.backends.layout import CGROUP_DIR, HostView, _searchable, box_env, unplaceable_mount

HOST_TOP = ["bin", "etc", "usr", "lib", "proc", "dev", "tmp", "run", "home", "root", "var", "sys"]
LINKS = {"/bin": "usr/bin", "/lib": "usr/lib"}
EXISTING = {
    "/root",
    "/root/.ssh",
    "/etc/shadow",
    "/etc/ssh",
    "/usr",
    "/etc/ld.so.cache",
    "/ws/.git",
}
DIRS = {"/root", "/root/.ssh", "/etc/ssh", "/usr", "/ws/.git"}


def fake_host() -> HostView:
    return HostView(
        home="/root",
        listdir=lambda _p: list(HOST_TOP),
        lexists=lambda p: p in EXISTING or p in LINKS,
        isdir=lambda p: p in DIRS,
        readlink=lambda p: LINKS[p],
        islink=lambda p: p in LINKS,
    )


def inputs() -> BwrapInputs:
    return BwrapInputs(
        workspace=Path("/ws"),
        agent_dir=Path("/opt/corral/agent"),
        python="/usr/bin/python3.11",
        masked_file=Path("/run/corral/shared/masked-file"),
        masked_dir=Path("/run/corral/shared/masked-dir"),
        passwd_file=Path("/run/corral/shared/passwd"),
        fds=BwrapFds(info=5, userns_block=6, seccomp=7),
        agent_args=("{}",),
    )


def argv(policy: Policy | None = None) -> list[str]:
    return bwrap_argv(policy or Policy(), inputs(), fake_host())


def triples(args: list[str], flag: str) -> list[tuple[str, str]]:
    return [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == flag]


def test_every_namespace_is_unshared() -> None:
    args = argv()
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        "--unshare-net",
    ):
        assert flag in args
    assert "--die-with-parent" in args
    assert "--new-session" in args


def test_the_agent_keeps_only_setuid_and_setgid() -> None:
    args = argv()
    caps = [args[i + 1] for i, a in enumerate(args) if a == "--cap-add"]
    assert sorted(caps) == ["CAP_SETGID", "CAP_SETUID"]


def test_host_root_is_bound_read_only_entry_by_entry_without_private_dirs() -> None:
    args = argv()
    ro = dict(triples(args, "--ro-bind"))
    assert ro["/usr"] == "/usr"
    assert ro["/etc"] == "/etc"
    for private in ("/proc", "/dev", "/tmp", "/run", "/home"):
        assert private not in ro, private
    assert ("usr/bin", "/bin") in triples(args, "--symlink")
    assert args[args.index("--remount-ro") + 1] == "/"


def test_private_tmp_is_size_capped() -> None:
    args = argv(Policy.from_dict({"filesystem": {"tmp_size": "32M"}}))
    i = next(i for i, a in enumerate(args) if args[i : i + 2] == ["--tmpfs", "/tmp"])
    assert args[i - 2 : i + 2] == ["--size", str(32 << 20), "--tmpfs", "/tmp"]


def test_host_cgroupfs_is_covered_when_sys_is_bound() -> None:
    args = argv()
    if ("/sys", "/sys") in triples(args, "--ro-bind"):
        i = next(i for i, a in enumerate(args) if args[i : i + 2] == ["--tmpfs", CGROUP_DIR])
        assert args[i - 4 : i] == ["--perms", "0555", "--size", "4096"]


def test_options_leave_argv_for_the_args_fd() -> None:
    full = argv()
    kept, data = bwrap_args.hide_options(full)
    end = full.index("--")
    assert kept == [full[0], "--args", "", *full[end:]]
    assert data.split(b"\0")[:-1] == [a.encode() for a in full[1:end]]
    assert "--ro-bind" not in kept and "/ws" not in kept


def test_workspace_is_the_only_default_writable_bind() -> None:
    assert triples(argv(), "--bind") == [("/ws", "/workspace")]


def test_existing_deny_read_paths_are_masked_and_missing_ones_skipped() -> None:
    binds = triples(argv(), "--ro-bind")
    assert not any(dest.startswith("/root") for _, dest in binds)  # not in the box at all
    assert ("/run/corral/shared/masked-file", "/etc/shadow") in binds
    assert ("/run/corral/shared/masked-dir", "/etc/ssh") in binds
    assert not any(dest == "/root/.aws" for _, dest in binds)  # does not exist on the host


def test_masks_come_after_the_binds_they_cover() -> None:
    args = argv()
    assert args.index("/run/corral/shared/masked-dir") > args.index("/etc")


def test_deny_write_relative_to_workspace_binds_host_source_read_only() -> None:
    args = argv(Policy.from_dict({"filesystem": {"deny_write": [".git"]}}))
    assert ("/ws/.git", "/workspace/.git") in triples(args, "--ro-bind")


def test_mounts_and_allow_write() -> None:
    policy = Policy.from_dict(
        {
            "filesystem": {
                "mounts": [
                    {"host": "/data", "guest": "/data", "mode": "ro"},
                    {"host": "/cache", "guest": "/cache", "mode": "rw"},
                ],
                "allow_write": ["/srv/out"],
            }
        }
    )
    args = argv(policy)
    assert ("/data", "/data") in triples(args, "--ro-bind")
    assert ("/cache", "/cache") in triples(args, "--bind")
    assert ("/srv/out", "/srv/out") in triples(args, "--bind")


def test_minimal_root_binds_usr_but_not_the_host_root() -> None:
    args = argv(Policy.from_dict({"filesystem": {"inherit_readable": False}}))
    ro = triples(args, "--ro-bind")
    assert ("/usr", "/usr") in ro
    assert ("/etc", "/etc") not in ro
    assert ("/run/corral/shared/passwd", "/etc/passwd") in ro


def test_seccomp_fd_and_agent_command_come_last() -> None:
    args = argv()
    assert args[args.index("--seccomp") + 1] == "7"
    tail = args[args.index("--") + 1 :]
    assert tail == ["/usr/bin/python3.11", "-I", "-S", "/run/corral/agent/agent.py", "{}"]


def test_env_is_built_from_policy_not_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak")
    env = box_env(Policy.from_dict({"env": {"FOO": "1"}}))
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert env["FOO"] == "1"
    assert env["HOME"] == "/home/user"
    assert set(env) >= {"PATH", "HOME", "LANG", "TERM"}


@given(st.lists(st.sampled_from(["/data", "/srv/a", "/opt/x", "/mnt/y"]), unique=True, max_size=4))
def test_every_mount_appears_exactly_once(guests: list[str]) -> None:
    mounts = [{"host": g, "guest": g, "mode": "ro"} for g in guests]
    args = argv(Policy.from_dict({"filesystem": {"mounts": mounts}}))
    binds = triples(args, "--ro-bind")
    for g in guests:
        assert binds.count((g, g)) == 1


def test_paths_the_box_cannot_reach_need_no_mask() -> None:
    """A user's workspace: box uid 1000 maps to that user, who can't search /root anyway
    (and bwrap, as the box's root, couldn't make a mount point there)."""
    policy = Policy(filesystem={"deny_read": ("/root/.ssh", "/etc/shadow")})
    user_ws = replace(
        fake_host(),
        owner=lambda p: (4321, 4321),
        searchable=lambda p, uid, gid: not p.startswith("/root/") or uid == 0,
    )
    masked = bwrap_argv(policy, inputs(), user_ws)
    assert "/etc/shadow" in masked and "/root/.ssh" not in masked
    # Shared at its own path (idmapped: the box user owns what root owns): masked there.
    shared = policy.model_copy(
        update={
            "filesystem": policy.filesystem.model_copy(
                update={"mounts": (Mount(host=Path("/root"), guest="/root"),)}
            )
        }
    )
    mask = ("/run/corral/shared/masked-dir", "/root/.ssh")
    assert mask in triples(bwrap_argv(shared, inputs(), user_ws), "--ro-bind")


def test_searchable_follows_the_mode_bits_of_every_ancestor() -> None:
    base = Path(tempfile.mkdtemp(prefix="corral-search-"))  # /tmp itself is searchable
    try:
        base.chmod(0o755)
        locked = base / "locked"
        (locked / "inner").mkdir(parents=True)
        locked.chmod(0o700)
        target = str(locked / "inner" / "secret")
        assert _searchable(target, 0, 0)  # a root-owned workspace: host root is mapped
        assert not _searchable(target, 4321, 4321)
        os.chown(locked, 4321, 0)
        assert _searchable(target, 4321, 4321)  # the owner may search it
        os.chown(locked, 0, 4321)
        locked.chmod(0o710)
        assert _searchable(target, 4321, 4321)  # so may its group
        locked.chmod(0o701)
        os.chown(locked, 0, 0)
        assert _searchable(target, 4321, 4321)  # and everyone, here
    finally:
        shutil.rmtree(base)


def test_a_nested_mount_gets_listable_parents_once() -> None:
    policy = Policy(
        filesystem={
            "mounts": (
                {"host": "/srv/a", "guest": "/data/deep/a"},
                {"host": "/srv/b", "guest": "/data/deep/b"},
            )
        }
    )
    args = argv(policy)
    made = [args[i + 3] for i, a in enumerate(args) if a == "--perms" and args[i + 2] == "--dir"]
    assert made.count("/data") == 1 and made.count("/data/deep") == 1
    assert args.index("/data/deep") < args.index("/data/deep/a")


def test_a_mount_point_inside_a_read_only_host_dir_is_refused_with_the_fix() -> None:
    host = fake_host()
    bad = Policy(filesystem={"mounts": ({"host": "/srv", "guest": "/usr/new/x"},)})
    problem = unplaceable_mount(bad, host) or ""
    assert "/usr/new/x" in problem and "/usr is the host's own directory" in problem
    assert "/data/usr/new/x" in problem
    fine = Policy(filesystem={"mounts": ({"host": "/srv", "guest": "/data/x"},)})
    assert unplaceable_mount(fine, host) is None
    minimal = bad.model_copy(
        update={"filesystem": bad.filesystem.model_copy(update={"inherit_readable": False})}
    )
    assert unplaceable_mount(minimal, host) is None


# ---- the box of yesterday: masks never follow links, follow the host object -----------------


def test_a_mask_through_a_symlink_in_the_workspace_fails_closed() -> None:
    links = {"/ws/.git"}
    host = replace(
        fake_host(),
        islink=lambda p: p in links or p in LINKS,
        lexists=lambda p: p in EXISTING or p in LINKS or p in links,
    )
    for field in ("deny_write", "deny_read"):
        policy = Policy.from_dict({"filesystem": {field: [".git/hooks"]}})
        with pytest.raises(PolicyError, match=f"filesystem.{field} '.git/hooks'"):
            bwrap_argv(policy, inputs(), host)


def test_a_missing_deny_write_path_in_the_workspace_is_made_and_masked() -> None:
    made: list[tuple[str, str]] = []
    host = replace(fake_host(), placeholder=lambda area, rel: made.append((area, rel)))
    args = bwrap_argv(Policy.from_dict({"filesystem": {"deny_write": ["hooks"]}}), inputs(), host)
    assert made == [("/ws", "hooks")]
    assert ("/run/corral/shared/masked-dir", "/workspace/hooks") in triples(args, "--ro-bind")


def test_a_missing_deny_write_path_on_the_read_only_root_needs_nothing() -> None:
    host = replace(fake_host(), placeholder=None)
    args = bwrap_argv(Policy.from_dict({"filesystem": {"deny_write": ["/opt/x"]}}), inputs(), host)
    assert not any(dest == "/opt/x" for _, dest in triples(args, "--ro-bind"))


def test_a_mask_follows_the_host_object_into_the_workspace() -> None:
    """Workspace = $HOME (/root): ~/.ssh is masked at /root/.ssh and at /workspace/.ssh."""
    ids = {"/root": (1, 2), "/root/.ssh": (1, 3), "/ws": (1, 2)}
    host = replace(fake_host(), ident=lambda p: ids.get(p))
    binds = triples(bwrap_argv(Policy(), inputs(), host), "--ro-bind")
    assert not any(dest == "/root/.ssh" for _, dest in binds)  # /root is not in the box
    assert ("/run/corral/shared/masked-dir", "/workspace/.ssh") in binds
    assert ("/run/corral/shared/masked-file", "/workspace/.ssh") not in binds


def test_the_hosts_capped_devpts_covers_bwraps_own() -> None:
    plain = argv()
    assert "/dev/pts" not in [dest for _, dest in triples(plain, "--dev-bind")]
    capped = bwrap_argv(Policy(), replace(inputs(), devpts=Path("/run/corral/devpts")), fake_host())
    assert ("/run/corral/devpts", "/dev/pts") in triples(capped, "--dev-bind")
    assert capped.index("--dev-bind") > capped.index("--dev")


def test_the_default_root_is_the_host_system_not_its_data() -> None:
    top = [*HOST_TOP, "srv", "mnt", "media", "boot", "opt", "work", "vmlinuz"]
    host = replace(
        fake_host(),
        listdir=lambda _p: top,
        isdir=lambda p: p in DIRS or p in {"/var/lib/dpkg", "/opt"},
    )
    args = bwrap_argv(Policy(), inputs(), host)
    dests = {d for _, d in triples(args, "--ro-bind")} | {d for _, d in triples(args, "--bind")}
    assert {"/usr", "/etc", "/opt", "/var/lib/dpkg"} <= dests
    for data in ("/root", "/srv", "/mnt", "/media", "/boot", "/work", "/vmlinuz", "/var"):
        assert data not in dests, data
    links = {d: t for t, d in triples(args, "--symlink")}
    assert links["/var/tmp"] == "/tmp" and links["/var/run"] == "/run"
    # /var is the box's own directory, listable, holding only those.
    assert args[args.index("/var") - 3 : args.index("/var")] == ["--perms", "0755", "--dir"]


def test_the_box_has_its_own_passwd_and_group_on_every_root() -> None:
    for policy in (Policy(), Policy.from_dict({"filesystem": {"inherit_readable": False}})):
        ro = triples(argv(policy), "--ro-bind")
        assert ("/run/corral/shared/passwd", "/etc/passwd") in ro
        assert ("/run/corral/shared/group", "/etc/group") in ro
        assert ro.index(("/run/corral/shared/passwd", "/etc/passwd")) > next(
            (i for i, b in enumerate(ro) if b[1] == "/etc"), -1
        )


def test_deny_write_never_shows_a_hidden_host_path() -> None:
    """A read-only bind of a ``deny_write`` path outside the box's view would add host data."""
    host = replace(fake_host(), lexists=lambda p: p in EXISTING or p == "/srv/data")
    args = bwrap_argv(
        Policy.from_dict({"filesystem": {"deny_write": ["/srv/data"]}}), inputs(), host
    )
    assert not any("/srv" in a for a in args)


def test_host_data_is_shown_where_the_policy_mounts_it() -> None:
    policy = Policy.from_dict(
        {"filesystem": {"mounts": [{"host": "/srv/data", "guest": "/srv/data"}]}}
    )
    args = argv(policy)
    assert ("/srv/data", "/srv/data") in triples(args, "--ro-bind")
    assert unplaceable_mount(policy, fake_host()) is None  # /srv is the box's own directory


def test_binds_in_writable_areas_can_come_from_descriptors() -> None:
    args = ["bwrap", "--bind", "/ws", "/workspace", "--ro-bind", "/ws/.git", "/workspace/.git"]
    args += ["--ro-bind", "/usr", "/usr", "--", "agent", "--bind", "/ws", "/x"]
    assert bwrap_args.bind_sources(args) == ["/ws", "/ws/.git", "/usr"]
    out = bwrap_args.binds_by_fd(args, {"/ws": 7, "/ws/.git": 8})
    assert out[:10] == [
        "bwrap",
        "--bind-fd",
        "7",
        "/workspace",
        "--ro-bind-fd",
        "8",
        "/workspace/.git",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    assert out[out.index("--") :] == args[args.index("--") :]  # the command is left alone


def test_a_writable_image_root_is_the_overlay_bound_whole(tmp_path: Path) -> None:
    """A writable image root is bound at / (new top-level entries can be made) and not
    sealed read-only; a read-only one is the image's entries on bwrap's tmpfs, sealed. Box
    root's commands get the capabilities of ROOT_CAPS, others only CAP_SETUID/CAP_SETGID."""
    root = tmp_path / "merged"
    (root / "usr").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    (root / "bin").symlink_to("usr/bin")
    writable = replace(inputs(), image_root=root, image_writable=True, root_commands=True)
    args = bwrap_argv(Policy(), writable, fake_host())
    assert triples(args, "--bind")[0] == (str(root), "/")
    assert "--remount-ro" not in args and "/etc/passwd" not in args  # the image's own passwd
    assert all(cap in args for cap in bwrap_args.ROOT_CAPS)
    assert bwrap_args.placeholders(args, root) >= {"workspace", "dev", "proc", "tmp"}
    assert "usr" not in bwrap_args.placeholders(args, root)
    read_only = replace(inputs(), image_root=root)
    args = bwrap_argv(Policy(), read_only, fake_host())
    assert (str(root / "usr"), "/usr") in triples(args, "--ro-bind")
    assert ("usr/bin", "/bin") in triples(args, "--symlink")
    assert args[args.index("--remount-ro") + 1] == "/"
    assert not any(cap in args for cap in bwrap_args.ROOT_CAPS)


def test_an_image_link_on_a_mount_destination_is_found(tmp_path: Path) -> None:
    root = tmp_path / "merged"
    root.mkdir()
    (root / "srv").symlink_to("/etc")
    policy = Policy(filesystem={"mounts": [{"host": str(tmp_path), "guest": "/srv/in"}]})
    for writable in (True, False):
        inp = replace(inputs(), image_root=root, image_writable=writable)
        args = bwrap_argv(policy, inp, fake_host())
        found = bwrap_args.image_link_in_the_way(args, root, writable)
        assert found in ("/srv", "/srv/in"), found  # the parent bwrap makes, or the share
    (root / "srv").unlink()
    (root / "srv").mkdir()
    args = bwrap_argv(policy, replace(inputs(), image_root=root, image_writable=True))
    assert bwrap_args.image_link_in_the_way(args, root, True) is None


def test_one_translation_looks_at_each_host_path_once() -> None:
    """Masks compare their ancestors with every bound directory by (st_dev, st_ino): each
    path is looked at once per translation (and again in the next one: nothing is kept)."""
    looked: list[str] = []
    ids = {"/root": (1, 2), "/root/.ssh": (1, 3), "/ws": (1, 2)}

    def ident(path: str) -> tuple[int, int] | None:
        looked.append(path)
        return ids.get(path)

    host = replace(fake_host(), ident=ident)
    policy = Policy()  # its masks: /etc/shadow, /etc/ssh, ~/.ssh, ...
    binds = triples(bwrap_argv(policy, inputs(), host), "--ro-bind")
    assert ("/run/corral/shared/masked-dir", "/workspace/.ssh") in binds  # still followed
    assert looked and len(looked) == len(set(looked))
    first = len(looked)
    bwrap_argv(policy, inputs(), host)
    assert len(looked) == 2 * first


def test_the_hosts_sys_is_bound_after_the_system_and_before_the_policy() -> None:
    """/sys (with its submounts) is bound once the system view, /dev and /proc are built
    (bwrap re-reads the mount table after each bind: they read it without /sys's ~13
    submounts), its cgroupfs covered right after, and before any policy bind, so a mask
    below /sys still lands on it."""
    host = replace(fake_host(), lexists=lambda p: p in EXISTING or p == "/sys/kernel/mm")
    policy = Policy.from_dict({"filesystem": {"deny_read": ["/sys/kernel/mm"]}})
    args = bwrap_argv(policy, inputs(), host)
    at = next(i for i in range(len(args)) if args[i : i + 3] == ["--ro-bind", "/sys", "/sys"])
    assert args[at + 3 : at + 9] == ["--perms", "0555", "--size", "4096", "--tmpfs", CGROUP_DIR]
    before, after = args[:at], args[at:]
    assert "/proc" in before and "/dev" in before and "/usr" in before
    assert not any(a.startswith("/sys") for a in before)
    mask = next(i for i, a in enumerate(after) if a == "/sys/kernel/mm")
    assert after[mask - 2] == "--ro-bind" and mask > 3
    assert after.index("/workspace") > 3  # the policy's binds all come after it
