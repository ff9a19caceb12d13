"""What a box sees of the host: its *system* read-only, never its data (every backend).

The host files these tests plant are world-readable on purpose: only the box's view may hide
them, not their modes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import one_id_skip
from corral import Mount, Policy, Sandbox

pytestmark = pytest.mark.needs_bwrap

DATA_TOPS = ("/srv", "/mnt", "/media", "/home", "/root", "/var/lib", "/")


@pytest.fixture(scope="module")
def host_data() -> Iterator[list[Path]]:
    """A readable file in each place host data lives (a directory of its own in each). In the
    rootless slice, where the user may not write those places, the slice's runner (root)
    made them: ``CORRAL_TEST_HOST_DATA`` lists them."""
    ready = os.environ.get("CORRAL_TEST_HOST_DATA")
    if ready:
        yield [Path(p) for p in ready.split(":")]
        return
    made: list[Path] = []
    try:
        for top in DATA_TOPS:
            if not Path(top).is_dir():
                continue
            where = Path(tempfile.mkdtemp(prefix="corral-view-", dir=top))
            where.chmod(0o755)
            secret = where / "secret.txt"
            secret.write_text("host data\n")
            secret.chmod(0o644)
            made.append(where)
        yield made
    finally:
        for where in made:
            shutil.rmtree(where, ignore_errors=True)


async def test_host_data_is_not_in_the_box(sandbox: Sandbox, host_data: list[Path]) -> None:
    paths = " ".join(str(d / "secret.txt") for d in host_data)
    r = await sandbox.run(f"for p in {paths}; do cat $p 2>/dev/null && echo LEAK $p; done; ls /")
    assert "LEAK" not in r.stdout and "host data" not in r.stdout, r.stdout
    top = set(r.stdout.split())
    assert not top & {"srv", "mnt", "media", "root", "boot"}, top
    assert {"usr", "etc", "bin", "tmp", "home", "workspace"} <= top
    r = await sandbox.run("ls -A /home /var /var/lib; ls /root/.ssh")
    assert r.stdout.split() == ["/home:", "user", "/var:", "lib", "lock", "run", "tmp"] + (
        ["/var/lib:", "dpkg"] if Path("/var/lib/dpkg").is_dir() else ["/var/lib:"]
    ), r.stdout
    assert r.exit_code != 0  # the operator's ~/.ssh: not there at all


async def test_host_data_is_there_where_the_policy_mounts_it(
    box_policy: Policy, workspace: Path, host_data: list[Path]
) -> None:
    shared = host_data[0]
    fs = box_policy.filesystem.model_copy(
        update={"mounts": (Mount(host=shared, guest=str(shared)),)}
    )
    async with Sandbox(box_policy.model_copy(update={"filesystem": fs}), workspace=workspace) as sb:
        r = await sb.run(["cat", str(shared / "secret.txt")])
        assert (r.exit_code, r.stdout) == (0, "host data\n")
        others = " ".join(str(d / "secret.txt") for d in host_data[1:])
        r = await sb.run(f"cat {others}")
        assert "host data" not in r.stdout


@one_id_skip("id, $USER and the home are box root's; the programs run all the same")
async def test_programs_and_the_box_user_work_on_the_system_view(sandbox: Sandbox) -> None:
    r = await sandbox.run(
        "set -e; id -un; id -gn; echo $USER; stat -c '%U %a' /home/user; sh -c 'echo sh';"
        " python3 -c 'import ssl, sqlite3; print(\"py\")'; git --version >/dev/null;"
        " python3 -m pip --version >/dev/null; echo ok"
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["user", "user", "user", "user", "755", "sh", "py", "ok"]
    r = await sandbox.run(
        "git init -q . && echo x > f && git add f && git commit -qm first"
        " && git log --format=%an%ae"
    )
    assert (r.exit_code, r.stdout.strip()) == (0, "box useruser@corral.invalid"), r.stderr
    # The repository's own identity (or the policy's env) still wins over the default.
    r = await sandbox.run(
        "git -c user.name=Ann -c user.email=ann@example.org commit -q --allow-empty -m 2"
        " && git log -1 --format=%an%ae"
    )
    assert r.stdout.strip() == "Annann@example.org"


async def test_the_home_stays_writable_with_a_mount_below_it(
    box_policy: Policy, workspace: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    fs = box_policy.filesystem.model_copy(
        update={"mounts": (Mount(host=data, guest="/home/user/data"),)}
    )
    async with Sandbox(box_policy.model_copy(update={"filesystem": fs}), workspace=workspace) as sb:
        r = await sb.run("touch ~/state && ls ~")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["data", "state"]
