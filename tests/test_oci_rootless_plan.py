"""The rootless OCI mode's pure parts: how the runtime is called, the box's id maps. Real
rootless OCI boxes run in tests/rootless/ as an unprivileged user."""

from __future__ import annotations

import pytest

from corral.backends.host.subids import RootlessProbe, SubIds
from corral.backends.oci import rootless
from corral.backends.oci.rootless import RootlessMode, outer_argv
from corral.errors import BackendUnavailable


def probe(start: int | None) -> RootlessProbe:
    ids = SubIds(start, 65536 if start else 0, start, 65536 if start else 0)
    why = None if start else "no subordinate ids"
    tools = ("/usr/bin/newuidmap", "/usr/bin/newgidmap")
    return RootlessProbe("u", 1234, 1234, None, *tools, ids, why)


def test_with_subordinate_ids_the_runtime_is_root_over_the_user_and_the_range() -> None:
    argv = outer_argv("/usr/bin/unshare", probe(100000), None)
    assert argv == (
        "/usr/bin/unshare",
        "--user",
        "--mount",
        "--map-user=0",
        "--map-group=0",
        "--map-users=100000,1,65535",
        "--map-groups=100000,1,65535",
        "--",
    )


def test_without_them_the_runtime_is_root_over_the_user_alone() -> None:
    argv = outer_argv("/usr/bin/unshare", probe(None), None)
    assert argv == ("/usr/bin/unshare", "--user", "--mount", "--map-root-user", "--")


def test_crun_on_a_hybrid_host_has_the_cgroup2_mount_covered_first() -> None:
    argv = outer_argv("/usr/bin/unshare", probe(None), "/sys/fs/cgroup/unified")
    tail = argv[argv.index("--") + 1 :]
    assert tail[:2] == ("/bin/sh", "-c") and tail[3] == "/sys/fs/cgroup/unified"
    assert "mount -t tmpfs -o ro" in tail[2] and 'exec "$@"' in tail[2]


def test_box_ids_land_where_a_rootless_bwrap_boxs_do() -> None:
    """Outer 0 is the user, outer n the range's n-th id: box 1000 (commands) is the user,
    box root the range's first id, nothing mapped twice."""
    mapped = RootlessMode((), mapped=True, warning=None).box_ranges
    assert mapped == ((0, 1, 1000), (1000, 0, 1), (1001, 1001, 64535))
    outer = [o + i for _, o, n in mapped for i in range(n)]
    assert len(set(outer)) == len(outer) == 65536 and max(outer) <= rootless.OUTER_IDS
    assert RootlessMode((), mapped=False, warning="w").box_ranges == ((0, 0, 1),)


def test_runsc_is_refused_with_the_way_out() -> None:
    with pytest.raises(BackendUnavailable, match="runtime 'crun' or 'runc'"):
        rootless.rootless_mode("runsc", None)
