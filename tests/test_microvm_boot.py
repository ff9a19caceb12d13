"""The microVM's boot pieces that need no VM: the boot script, the saved-VM keys and their
cache, the precompiled agent and the extracted kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from corral.backends.base import AGENT_DIR
from corral.backends.host.python import find_python
from corral.backends.layout import Bind, Symlink
from corral.backends.microvm import box as microvm_box
from corral.backends.microvm import initramfs, jail, vmpython, vmsnap

PLAN = initramfs.BootPlan(
    shares=(initramfs.Share("ws", "/workspace", False),),
    hostname="cb-test",
    uid=1000,
    gid=1000,
    tmp_size=1 << 20,
    agent_config='{"device":"/dev/corral"}',
)


def run_sh(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
    )


def test_the_boot_script_carries_the_seccomp_filter_byte_for_byte(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 9  # every byte value, several base64 lines
    script = initramfs.boot_script(replace(PLAN, seccomp=blob))
    start = script.index("base64 -d")
    heredoc = script[start : script.index("CORRAL_EOF\n", start + 40) + len("CORRAL_EOF\n")]
    (tmp_path / "run/corral/agent").mkdir(parents=True)
    done = run_sh(f"R={tmp_path}\n{heredoc}", tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run/corral/agent/seccomp.bpf").read_bytes() == blob


def test_the_payload_carries_script_config_and_clock() -> None:
    payload = initramfs.boot_payload(PLAN, 1795000000.25)
    size, _, body = payload.partition(b"\n")
    assert int(size) == len(body)
    boot = json.loads(body)
    assert boot["script"] == initramfs.boot_script(PLAN)
    assert boot["config"] == {"device": "/dev/corral"}
    assert boot["clock"] == 1795000000.25
    assert boot["agent_dir"] == initramfs.GUEST_AGENT_DIR


def test_the_guest_checks_the_masks_a_box_could_redirect() -> None:
    """Masks inside a writable share are checked by the guest after its mounts; masks on
    the read-only root, or covered by another mask, are not (nothing can swap them, or
    they are not visible)."""
    plan = replace(
        PLAN,
        checked=("/workspace", "/data"),
        deny_read=("/etc/shadow", "/workspace/secrets", "/workspace/secrets/key", "/data/k"),
        deny_write=("/workspace/.git", "/workspace/secrets/x", "/srv/ro"),
    )
    checks = initramfs.mask_checks(plan)
    assert checks == {
        "hidden": ["/workspace/secrets", "/data/k"],
        "read_only": ["/workspace/.git"],
    }
    boot = json.loads(initramfs.boot_payload(plan, 0.0).partition(b"\n")[2])
    assert boot["checks"] == checks


def test_the_init_starts_the_agent_from_the_initramfs() -> None:
    init = initramfs.init_script("/usr/bin/python3.11")
    assert init.splitlines()[3].startswith('if [ "$corralmode" = raw ]')  # before any work
    assert 'exec /usr/bin/python3.11 -I -S /agent/agent.py --vm-init "$PORT"' in init


def test_the_packed_python_runs_the_agents_imports_with_nothing_else(tmp_path: Path) -> None:
    """The initramfs's interpreter, libraries and modules, alone in a chroot, import what the
    agent imports before the snapshot point (a missing file fails here, not in a VM)."""
    python = find_python()
    files, dirs = vmpython.runtime_files(python)
    for path in [*files, *(d / ".keep" for d in dirs)]:
        target = tmp_path / str(path).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.name != ".keep":
            shutil.copy2(path, target)
    shutil.copytree(AGENT_DIR, tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    probe = (
        "import importlib, sys; sys.path.insert(0, '/agent'); import vminit\n"
        "[importlib.import_module(m) for m in vminit.VM_PRELOAD]; print(len(sys.modules))"
    )
    done = subprocess.run(
        ["chroot", str(tmp_path), python, "-I", "-S", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "bin/sh").exists()  # really nothing else there


SHAPE = vmsnap.Shape(
    qemu=sys.executable,
    image=sys.executable,
    initrd=__file__,
    accel="tcg",
    machine="q35",
    cpus=1,
    memory_mb=512,
    shares=2,
    devices="-device virtio-serial-pci",
)


def test_a_saved_vm_is_keyed_on_everything_a_restore_must_match(tmp_path: Path) -> None:
    keys = {SHAPE.key()}
    for change in (
        {"cpus": 2},
        {"memory_mb": 256},
        {"shares": 3},
        {"machine": "microvm"},
        {"accel": "kvm"},
        {"devices": "-device virtio-serial-device"},
    ):
        keys.add(replace(SHAPE, **change).key())
    assert len(keys) == 7
    image = tmp_path / "vmlinux"
    image.write_bytes(b"v1")
    before = replace(SHAPE, image=str(image)).key()
    os.utime(image, ns=(1, 1))  # a new kernel file under the same name
    assert replace(SHAPE, image=str(image)).key() != before
    assert vmsnap.snapshot_path(SHAPE).name == f"{SHAPE.key()}.vm"
    initrd = tmp_path / "initramfs-x.cpio"
    initrd.write_bytes(b"archive")
    used = replace(SHAPE, initrd=str(initrd)).key()
    os.utime(initrd, ns=(2, 2))  # the archive cache marks it used: the same saved VM
    assert replace(SHAPE, initrd=str(initrd)).key() == used


def test_qemus_jail_holds_its_files_the_view_and_the_shares_alone(tmp_path: Path) -> None:
    """Every bind of the jail is made from a descriptor; nothing of the host's root, /home,
    /tmp, /run or /sys is bound, and qemu is the box user of its own namespaces."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    rt = jail.Runtime(files=(("/bin/sh", "/usr/bin/sh"),), dirs=("/usr/share",), links=())
    view = jail.view_entries(
        [Bind("/etc", "/etc"), Bind("/sys", "/sys"), Bind("/home", "/home"), Symlink("x", "/y")]
    )
    assert [e.dest for e in view] == ["/etc", "/y"]
    fds = jail.JailFds()
    try:
        argv = jail.jail_argv(
            "bwrap",
            ["qemu", "-x"],
            rt=rt,
            fds=fds,
            run_dir=str(run_dir),
            boot_files=["/bin/true"],
            view=view,
            shares=[jail.Share("ws", str(ws), True)],
            info_fd=5,
            block_fd=6,
            kvm=False,
        )
        opened = [os.readlink(f"/proc/self/fd/{fd}") for fd in fds.fds]
    finally:
        fds.close()
    assert argv[-3:] == ["--", "qemu", "-x"]
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net"):
        assert flag in argv
    assert argv[argv.index("--uid") + 1] == argv[argv.index("--gid") + 1] == str(jail.QEMU_UID)
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert not {"--bind", "--ro-bind", "--dev-bind"} & set(argv)  # only descriptors
    dests = [argv[i + 2] for i, a in enumerate(argv) if a in ("--ro-bind-fd", "--bind-fd")]
    assert dests == ["/usr/bin/sh", "/usr/share", "/bin/true", "/view/etc", "/shares/ws", "/run/vm"]
    assert opened == [os.path.realpath(p) for p in ("/bin/sh", "/usr/share", "/bin/true")] + [
        "/etc",
        str(ws),
        str(run_dir),
    ]
    writable = [argv[i + 2] for i, a in enumerate(argv) if a == "--bind-fd"]
    assert writable == ["/shares/ws", "/run/vm"]


def test_qemus_runtime_is_found_and_its_sandbox_denies_spawning() -> None:
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        pytest.skip("qemu is not installed")
    rt = jail.runtime(qemu)
    assert rt.files == ((qemu, qemu),)
    assert any(os.path.exists(os.path.join(d, "libc.so.6")) for d in rt.dirs)
    assert any(os.path.isdir(os.path.join(d, "qemu")) for d in rt.dirs)  # its modules
    assert any(os.path.isfile(os.path.join(d, "bios-256k.bin")) for d in rt.dirs)
    assert "spawn=deny" in jail.SANDBOX and "elevateprivileges=deny" in jail.SANDBOX


def test_the_cache_keeps_the_most_recent_snapshots_and_no_dead_partial_file(
    tmp_path: Path,
) -> None:
    for n in range(5):
        (tmp_path / f"s{n}.vm").write_bytes(b"x")
        os.utime(tmp_path / f"s{n}.vm", (1000 + n, 1000 + n))
    dead = tmp_path / f"s9.tmp{2**22 + 12345}"  # above pid_max's default: no such process
    live = tmp_path / f"s8.tmp{os.getpid()}"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    vmsnap.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3.vm", "s4.vm", live.name]


def test_the_agent_is_shipped_compiled_and_the_pycs_are_used(tmp_path: Path) -> None:
    sources = sorted(AGENT_DIR.glob("*.py"))
    pycs = initramfs.compiled_agent(sys.executable, sources)
    assert {name.split(".")[0] for name in pycs} == {p.stem for p in sources}
    (tmp_path / "__pycache__").mkdir()
    for name, data in pycs.items():
        (tmp_path / "__pycache__" / name).write_bytes(data)
    for source in sources:  # every module's source a stub: only its pyc can make it work
        (tmp_path / source.name).write_text("raise SystemExit('the source was compiled')\n")
    probe = "import sys; sys.path.insert(0, '.'); import protocol; print(protocol.__name__)"
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.stdout == "protocol\n", done.stderr  # unchecked-hash pycs: the stub is never read
    assert initramfs.compiled_agent("/nonexistent/python", sources) == {}


def test_the_kernel_is_extracted_for_a_direct_boot() -> None:
    try:
        kernel = initramfs.find_kernel()
    except initramfs.KernelNotFound as exc:
        pytest.skip(str(exc))
    image = initramfs.boot_image(kernel)
    if image == kernel.image:
        pytest.skip(f"{kernel.image} has no PVH entry or payload this host can extract")
    assert image.read_bytes()[:4] == b"\x7fELF"
    assert image.stat().st_size > kernel.image.stat().st_size  # uncompressed
    assert initramfs.boot_image(kernel) == image  # cached


def test_a_new_initramfs_keeps_the_archives_other_corrals_may_boot_from(tmp_path: Path) -> None:
    """Two corral versions (two checkouts, an upgrade) share one cache: a build must not
    remove the archive the other is about to hand to qemu, only the least recently used."""
    for age, name in enumerate(["d", "c", "b", "a"]):
        archive = tmp_path / f"initramfs-6.1-{name}.cpio"
        archive.write_bytes(b"x")
        os.utime(archive, (1000.0 - age, 1000.0 - age))
    (tmp_path / "initramfs-5.10-old.cpio").write_bytes(b"other kernel")
    initramfs._prune_archives(tmp_path, "initramfs-6.1-*.cpio", keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [
        "initramfs-5.10-old.cpio",
        "initramfs-6.1-b.cpio",
        "initramfs-6.1-c.cpio",
        "initramfs-6.1-d.cpio",
    ]


def test_a_cache_file_removed_by_another_process_reads_as_never_used(tmp_path: Path) -> None:
    assert vmsnap.last_used(tmp_path / "gone.vm") == 0.0


def test_the_console_tail_reads_no_link_and_no_fifo_qemu_leaves(tmp_path: Path) -> None:
    """qemu's run directory is qemu's: what corral reads there for an error message must be
    the console log itself, never a file a compromised qemu points it to."""
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    link = tmp_path / "console.log"
    link.symlink_to(secret)
    assert microvm_box.console_tail(link) == ""
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert microvm_box.console_tail(fifo) == ""  # and it does not block
    real = tmp_path / "real.log"
    real.write_text("x" * 3000 + "the end\n")
    tail = microvm_box.console_tail(real)
    assert tail.endswith("the end") and len(tail) <= 1500


def test_the_console_tail_keeps_the_inits_sentence_before_a_panic(tmp_path: Path) -> None:
    """The init's refusal (a mask not where it must be) comes before the kernel's panic
    trace, longer than the tail: the error still says why."""
    log = tmp_path / "console.log"
    log.write_text("boot\ncorral-init: the mask at /workspace/x cannot be reached\n" + "t" * 3000)
    tail = microvm_box.console_tail(log)
    assert tail.startswith("corral-init: the mask at /workspace/x cannot be reached ... ttt")
