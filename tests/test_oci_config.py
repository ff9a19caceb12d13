"""``Policy -> OCI config.json`` is pure: these tests run no process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral import Policy
from corral.backends.host import seccomp
from corral.backends.layout import HostView, Symlink
from corral.backends.limits import Capabilities, plan_limits
from corral.backends.oci import config as oci_config
from corral.backends.oci.config import OciBundle, OciInputs, oci_bundle
from corral.backends.users import HOST_UID_BASE, OWNER_UID_BASE

HOST_TOP = [
    "bin",
    "etc",
    "usr",
    "proc",
    "dev",
    "tmp",
    "run",
    "home",
    "root",
    "sys",
    "opt",
    "mnt",
    "srv",
    "x.json",
]
LINKS = {"/bin": "usr/bin"}
EXISTING = {"/root", "/root/.ssh", "/etc/shadow", "/etc/ssh", "/usr", "/ws/.git", "/x.json"}
DIRS = {
    "/root",
    "/root/.ssh",
    "/etc",
    "/etc/ssh",
    "/usr",
    "/ws",
    "/ws/.git",
    "/mnt",
    "/opt",
    "/data",
}


def fake_host() -> HostView:
    return HostView(
        home="/root",
        listdir=lambda _p: list(HOST_TOP),
        lexists=lambda p: p in EXISTING or p in LINKS,
        isdir=lambda p: p in DIRS or p.startswith("/opt/corral"),
        readlink=lambda p: LINKS[p],
        islink=lambda p: p in LINKS,
    )


def inputs(**update: Any) -> OciInputs:
    base: dict[str, Any] = {
        "sandbox_id": "cb-0123456789ab",
        "workspace": Path("/ws"),
        "owner_uid": 1234,
        "owner_gid": 1235,
        "agent_dir": Path("/opt/corral/agent"),
        "python": "/usr/bin/python3.11",
        "masked_file": Path("/run/corral/shared/masked-file"),
        "masked_dir": Path("/run/corral/shared/masked-dir"),
        "passwd_file": Path("/run/corral/shared/passwd"),
        "agent_args": ("{}",),
        "host_mounts": (
            "/",
            "/opt/inner",
            "/mnt/inner",
            "/proc",
            "/sys/fs/cgroup/memory",
            "/tmp/x",
        ),
    }
    return OciInputs(**{**base, **update})


def bundle(policy: Policy | None = None, **update: Any) -> OciBundle:
    return oci_bundle(policy or Policy(), inputs(**update), fake_host())


def mounts_at(config: dict[str, Any], dest: str) -> list[dict[str, Any]]:
    return [m for m in config["mounts"] if m["destination"] == dest]


def binds(config: dict[str, Any]) -> list[tuple[str, str, bool]]:
    return [
        (m["source"], m["destination"], "rw" in m["options"])
        for m in config["mounts"]
        if m["type"] == "bind"
    ]


def test_every_namespace_is_new_and_the_network_empty() -> None:
    linux = bundle().config["linux"]
    kinds = [ns["type"] for ns in linux["namespaces"]]
    assert sorted(kinds) == sorted(["user", "pid", "ipc", "uts", "mount", "cgroup", "network"])
    assert all("path" not in ns for ns in linux["namespaces"])
    assert bundle().config["hostname"] == "corral"


def test_a_prepared_network_namespace_is_joined() -> None:
    linux = bundle(netns_path="/run/netns/box").config["linux"]
    assert {"type": "network", "path": "/run/netns/box"} in linux["namespaces"]


def test_a_namespace_made_by_its_own_owner_is_joined_with_box_root_mapped_to_it() -> None:
    owner = OWNER_UID_BASE + 3
    config = bundle(userns_path="/proc/1/fd/9", root_uid=owner).config
    linux = config["linux"]
    assert {"type": "user", "path": "/proc/1/fd/9"} in linux["namespaces"]
    assert linux["uidMappings"][0] == {"containerID": 0, "hostID": owner, "size": 1}
    assert linux["gidMappings"][0] == {"containerID": 0, "hostID": owner, "size": 1}
    assert "rlimits" not in config["process"]  # runc's prlimit from outside: the agent's own


def test_box_users_map_to_unprivileged_ids_and_the_workspace_owner() -> None:
    linux = bundle().config["linux"]
    assert linux["uidMappings"] == [
        {"containerID": 0, "hostID": HOST_UID_BASE, "size": 1000},
        {"containerID": 1000, "hostID": 1234, "size": 1},
        {"containerID": 1001, "hostID": HOST_UID_BASE + 1001, "size": 65536 - 1001},
    ]
    assert linux["gidMappings"][1] == {"containerID": 1000, "hostID": 1235, "size": 1}


def test_the_agent_is_box_root_with_setuid_setgid_only_and_no_new_privs() -> None:
    process = bundle().config["process"]
    assert process["user"] == {"uid": 0, "gid": 0}
    caps = process["capabilities"]
    for kind in ("bounding", "effective", "permitted"):
        assert sorted(caps[kind]) == ["CAP_SETGID", "CAP_SETUID"]
    assert caps["inheritable"] == caps["ambient"] == []
    assert process["noNewPrivileges"] is True
    assert process["args"] == [
        "/usr/bin/python3.11",
        "-I",
        "-S",
        "/run/corral/agent/agent.py",
        "{}",
    ]
    assert {"type": "RLIMIT_CORE", "hard": 0, "soft": 0} in process["rlimits"]
    assert not any(e.startswith(("HOME=", "AWS")) for e in process["env"])


def test_root_is_read_only_and_host_entries_are_bound_read_only() -> None:
    b = bundle()
    assert b.config["root"] == {"path": "rootfs", "readonly": True}
    bound = binds(b.config)
    assert ("/usr", "/usr", False) in bound
    assert ("/etc", "/etc", False) in bound
    assert Symlink("usr/bin", "/bin") in b.symlinks
    for own in ("/proc", "/dev", "/tmp", "/run", "/home", "/sys"):
        assert not any(dest == own for _, dest, _ in bound), own
    for option in ("nosuid", "nodev", "rbind"):
        assert all(option in m["options"] for m in b.config["mounts"] if m["type"] == "bind")


def test_submounts_of_read_only_binds_are_read_only_too() -> None:
    bound = binds(bundle().config)
    assert ("/opt/inner", "/opt/inner", False) in bound
    assert not any(dest.startswith("/mnt") for _, dest, _ in bound)  # host data: not there
    # /sys is the box's own read-only sysfs: no host cgroup mount comes along.
    assert not any(dest.startswith("/sys/") for _, dest, _ in bound)
    sysfs = mounts_at(bundle().config, "/sys")
    assert [m["type"] for m in sysfs] == ["sysfs"] and "ro" in sysfs[0]["options"]


def test_private_tmp_is_size_capped_and_world_writable() -> None:
    b = bundle(Policy.from_dict({"filesystem": {"tmp_size": "32M"}}))
    (tmp,) = mounts_at(b.config, "/tmp")
    assert tmp["type"] == "tmpfs"
    assert f"size={32 << 20}" in tmp["options"] and "mode=1777" in tmp["options"]
    # runc gives a tmpfs the mode of the directory under it.
    assert ("/tmp", 0o1777) in b.dirs


def test_workspace_is_the_only_default_writable_bind() -> None:
    assert [(s, d) for s, d, rw in binds(bundle().config) if rw] == [("/ws", "/workspace")]


def test_deny_read_masks_come_after_what_they_cover() -> None:
    bound = binds(bundle().config)
    assert not any(d.startswith("/root") for _, d, _ in bound)  # not in the box: no mask
    assert ("/run/corral/shared/masked-file", "/etc/shadow", False) in bound
    dests = [d for _, d, _ in bound]
    assert dests.index("/etc/shadow") > dests.index("/etc")
    assert not any(d == "/root/.aws" for d in dests)  # not on the host: nothing to hide


def test_proc_knobs_are_read_only_and_kernel_interfaces_masked() -> None:
    linux = bundle().config["linux"]
    assert {"/proc/sys", "/proc/sysrq-trigger"} <= set(linux["readonlyPaths"])
    assert {"/proc/kcore", "/proc/keys", "/sys/firmware"} <= set(linux["maskedPaths"])


def test_seccomp_is_corrals_filter_in_oci_form() -> None:
    sec = bundle(Policy.from_dict({"security": {"preset": "restricted"}})).config["linux"]
    assert sec["seccomp"] == seccomp.oci_seccomp("restricted")
    assert sec["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"


def test_limits_become_resources_in_an_explicit_cgroup() -> None:
    policy = Policy.from_dict({"limits": {"memory_bytes": "256M", "cpu_quota": 0.5}})
    linux = bundle(policy).config["linux"]
    assert linux["cgroupsPath"] == "/corral/cb-0123456789ab"
    res = linux["resources"]
    assert res["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert res["pids"] == {"limit": 256}
    assert res["cpu"] == {"quota": 50_000, "period": 100_000}
    assert res["devices"] == [{"allow": False, "access": "rwm"}]


def test_limits_the_host_cannot_enforce_are_not_sent() -> None:
    caps = Capabilities("cgroup v1", controllers=frozenset({"memory"}), swap="uncapped")
    policy = Policy.from_dict({"limits": {"cpu_quota": 1.0}})
    b = bundle(policy, limits=plan_limits(policy.limits, caps))
    res = b.config["linux"]["resources"]
    assert res["memory"] == {"limit": 1 << 30}  # no swap cap without memsw
    assert "pids" not in res and "cpu" not in res
    none = Capabilities("none", controllers=frozenset(), swap="inactive")
    res = bundle(policy, limits=plan_limits(policy.limits, none)).config["linux"]["resources"]
    assert res == {"devices": [{"allow": False, "access": "rwm"}]}


def test_resources_are_the_plans_numbers() -> None:
    policy = Policy.from_dict({"limits": {"memory_bytes": 100_000_001, "cpu_quota": 0.29}})
    res = bundle(policy).config["linux"]["resources"]
    assert res["memory"]["limit"] == 100_000_001 // 4096 * 4096  # whole pages
    assert res["cpu"] == {"quota": 29_000, "period": 100_000}  # not int(0.29 * 1e5) = 28999


def test_mount_points_outside_host_binds_are_made_in_the_root_dir() -> None:
    policy = Policy.from_dict(
        {"filesystem": {"mounts": [{"host": "/data", "guest": "/data/in/deep"}]}}
    )
    b = bundle(policy)
    dirs = dict(b.dirs)
    assert {"/workspace", "/proc", "/etc", "/data", "/data/in", "/data/in/deep"} <= set(dirs)
    assert "/x.json" not in b.files  # a top-level host file is host data
    assert "/run/corral/agent" not in dirs  # inside the box's /run tmpfs: the runtime's job
    assert "/etc/shadow" not in b.files  # exists on the host under the /etc bind


@given(st.lists(st.sampled_from(["/data", "/srv/a", "/opt/x", "/mnt/y"]), unique=True, max_size=4))
def test_every_shared_mount_appears_exactly_once(guests: list[str]) -> None:
    mounts = [{"host": g, "guest": g, "mode": "ro"} for g in guests]
    bound = binds(bundle(Policy.from_dict({"filesystem": {"mounts": mounts}})).config)
    for g in guests:
        assert bound.count((g, g, False)) == 1


# ---- runsc (gVisor) --------------------------------------------------------------------------
def test_gvisor_box_makes_every_mount_point_and_keeps_the_user_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(oci_config, "_other_can_open", lambda _p: True)
    b = bundle(gvisor=True, seccomp_file="/st/seccomp.bpf", compat_library="/st/c.so")
    dirs = dict(b.dirs)
    # Its file server, box root, cannot write the root dir: even points in /run are made.
    assert {"/run", "/run/corral", "/run/corral/agent", "/home/user"} <= set(dirs)
    assert {oci_config.GUEST_SECCOMP, oci_config.GUEST_COMPAT} <= set(b.files)
    linux = b.config["linux"]
    assert {"type": "user"} in linux["namespaces"]
    assert linux["uidMappings"] == bundle().config["linux"]["uidMappings"]
    assert "seccomp" not in linux  # the agent installs corral's own filter
    assert ("/st/seccomp.bpf", oci_config.GUEST_SECCOMP, False) in binds(b.config)
    assert mounts_at(b.config, "/sys")[0]["type"] == "sysfs"


def test_gvisor_box_leaves_out_masks_of_paths_its_file_server_cannot_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(oci_config, "_other_can_open", lambda p: p != "/etc/shadow")
    policy = Policy.from_dict({"filesystem": {"deny_read": ["/etc/shadow", "/etc/ssh", ".git"]}})
    dests = [d for s, d, _ in binds(bundle(policy, gvisor=True).config) if "masked" in s]
    # /etc/shadow: unreadable to an unmapped uid, so unreadable in the box without a mask;
    # masks inside the workspace always stay (its files are the box user's).
    assert dests == ["/etc/ssh", "/workspace/.git"]
    assert "/etc/shadow" in [d for _, d, _ in binds(bundle(policy).config)]


def test_other_can_open_follows_the_mode_bits(tmp_path: Path) -> None:
    public = tmp_path / "public"
    public.write_text("x")
    public.chmod(0o644)
    assert oci_config._other_can_open("/etc/passwd")
    assert not oci_config._other_can_open("/etc/shadow")  # 0640 root:shadow
    assert not oci_config._other_can_open(str(public))  # below pytest's 0700 directory


MAPPED = ((0, 1, 1000), (1000, 0, 1), (1001, 1001, 64535))


def test_a_rootless_box_has_the_runtimes_maps_and_no_cgroup() -> None:
    policy = Policy.from_dict({"limits": {"memory_bytes": 64 << 20, "max_pids": 50}})
    linux = bundle(policy, rootless=MAPPED).config["linux"]
    maps = [{"containerID": b, "hostID": h, "size": n} for b, h, n in MAPPED]
    assert linux["uidMappings"] == linux["gidMappings"] == maps
    assert "resources" not in linux and "cgroupsPath" not in linux  # limits are rlimits
    process = bundle(rootless=MAPPED).config["process"]
    assert sorted(process["capabilities"]["bounding"]) == ["CAP_SETGID", "CAP_SETUID"]
    home = mounts_at(bundle(rootless=MAPPED).config, "/home/user")[0]
    assert "uid=1000" in home["options"]


def test_a_rootless_box_with_one_id_keeps_no_capability_and_homes_box_root() -> None:
    config = bundle(rootless=((0, 0, 1),)).config
    caps = config["process"]["capabilities"]
    assert all(caps[kind] == [] for kind in caps)  # commands are box root: nothing to keep
    home = mounts_at(config, "/home/user")[0]
    assert "uid=0" in home["options"] and "gid=0" in home["options"]  # 1000 is not mapped
    assert config["linux"]["uidMappings"] == [{"containerID": 0, "hostID": 0, "size": 1}]


def test_a_writable_image_root_is_the_containers_root_with_the_hidden_interpreter(
    tmp_path: Path,
) -> None:
    """On ``policy.image`` the overlay is the container's root (no host entry bound), the
    agent runs with the host's interpreter from the host's /usr bound read-only at a hidden
    path in a 0700 tmpfs, and box root's commands get ROOT_CAPS over the box only."""
    from corral.backends.host.python import HOST_PREFIX, HiddenPython
    from corral.backends.users import ROOT_CAPS

    hidden = HiddenPython("/usr", (HOST_PREFIX + "/usr/lib/ld.so", HOST_PREFIX + "/usr/bin/py"))
    overlay_root = tmp_path / "merged"
    made = bundle(
        Policy(image="./img"),
        image_root=overlay_root,
        image_writable=True,
        hidden=hidden,
        root_commands=True,
        others=1_000_000_000,
    )
    config = made.config
    assert config["root"] == {"path": str(overlay_root), "readonly": False}
    assert config["process"]["args"][:2] == list(hidden.argv)
    assert ("/usr", HOST_PREFIX + "/usr", False) in binds(config)
    assert not [b for b in binds(config) if b[1] in ("/etc", "/bin", "/etc/passwd")]
    assert mounts_at(config, "/run/corral")[0]["options"][2] == "mode=700"
    assert set(ROOT_CAPS) <= set(config["process"]["capabilities"]["bounding"])
    ranges = {(m["containerID"], m["hostID"]) for m in config["linux"]["uidMappings"]}
    assert (1, 1_000_000_001) in ranges  # box root's other ids: its own block
    read_only = bundle(Policy(image="./img"), image_root=tmp_path, hidden=hidden).config
    assert read_only["root"] == {"path": "rootfs", "readonly": True}
    assert "CAP_CHOWN" not in read_only["process"]["capabilities"]["bounding"]


def test_root_destinations_skip_what_lies_in_a_new_filesystem() -> None:
    mounts = bundle().config["mounts"]
    dests = oci_config.root_destinations(mounts)
    assert "/workspace" in dests and "/run" in dests and "/dev" in dests
    assert not [d for d in dests if d.startswith(("/run/", "/dev/", "/proc/"))], dests
