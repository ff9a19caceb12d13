"""A box's root on an image, writable: overlayfs, the image read-only below, a per-box tmpfs
of ``filesystem.root_size`` above (the bwrap backend, as root).

Three staging entries per box (:mod:`corral.backends.host.staging`, released with the box's
other mounts: unmounted, then ``rmdir`` only)::

    <state>/mnt/<box>.image/ws   the overlay, bound into the box entry by entry (0700, the
                                 box's namespace owner: bwrap runs as it; no one else enters)
    <state>/mnt/<box>.lower/ws   the image's root, idmapped with the box's own id maps,
                                 read-only, nosuid, nodev (0700, host root's)
    <state>/mnt/<box>.upper/ws   a tmpfs (size=root_size, 0700, host root's) holding the
                                 overlay's ``upper`` and ``work`` directories

Why idmapped: the store keeps an image's owners as its layers say (root's files are host
uid 0's), and box root is an unprivileged host uid. Seen through the box's own id map, an
on-disk uid N is box uid N: root's files are box root's (``apt-get`` may replace them), the
box user's are uid 1000's, and nothing is host root's. The image on the host is never
written: overlayfs copies a file up into the tmpfs before it changes, and the lower mount is
read-only besides.

Why mounted by the host: bwrap 0.8 has no overlay option. The overlay is made by host root
with ``redirect_dir=off``, ``index=off``, ``metacopy=off`` (no redirect or metacopy xattr in
an upper a box wrote is ever followed) and ``nosuid,nodev``; the box reaches the upper only
through it and cannot set the ``trusted.overlay.*`` xattrs overlayfs acts on. When the box
ends, the tmpfs is unmounted: nothing it wrote is left on a host disk, and host code never
walks it then (:mod:`corral.images.export` reads a live upper as hostile, by fds).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.backends.host import cowstore, idmap, mounts, safepath, staging
from corral.backends.layout import Bind, image_entries
from corral.errors import BackendError

_MS_NOSUID_NODEV = mounts.MS_NOSUID | mounts.MS_NODEV
OVERLAY_OPTIONS = "redirect_dir=off,index=off,metacopy=off,xino=off"


@dataclass(frozen=True)
class ImageRoot:
    """An image's root as a box sees it."""

    root: Path
    """What the box's root entries are bound from: the overlay (or the read-only lower)."""
    upper: Path | None
    """The overlay's upper directory (what the box changed), None for a read-only root."""
    subvolume: Path | None = None
    """The btrfs subvolume holding ``upper`` (:mod:`.cowstore`: snapshots are O(1)), or
    None where the upper is a tmpfs."""


MOUNTER_ID = 0x7FFF_0000
"""The on-disk id host root (the overlay's mounter) has on an idmapped upper layer: overlayfs
makes its work files and whiteouts as the mounter, which must be mapped there; this id is
none of a box's (0..65535), so such entries show as nobody in every box."""


def root_inodes(size: int) -> int:
    """The inode cap of a writable root's tmpfs of ``size`` bytes: one per 2 KiB, at least
    8192 (tmpfs's own default is half the host's RAM pages: a box could otherwise hold
    millions of empty files' inodes in kernel memory within a small ``root_size``)."""
    return max(size // 2048, 8192)


def _new(name: str, entries: list[Path], owner: int = 0) -> Path:
    entry = staging.new_entry("mnt", name)
    entries.append(entry)  # released with the box, mounted or not
    os.chown(entry, owner, 0)
    entry.chmod(0o700)
    return entry / "ws"


def _tmpfs(target: Path, options: str) -> None:
    done = mounts.libc().mount(
        b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID_NODEV, options.encode()
    )
    if done != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}", str(target))


def _overlay(target: Path, lower: Path, upper: Path, work: Path) -> None:
    options = f"lowerdir={lower},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
    done = mounts.libc().mount(
        b"overlay", os.fsencode(target), b"overlay", _MS_NOSUID_NODEV, options.encode()
    )
    if done != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}", str(target))


def mount_image_root(
    sandbox_id: str,
    rootfs: Path,
    entries: list[Path],
    *,
    uids: Sequence[tuple[int, int, int]],
    gids: Sequence[tuple[int, int, int]],
    owner: int,
    size: int | None,
    workdir: str | None = None,
    seed: Path | None = None,
    release: list[Callable[[], None]] | None = None,
) -> ImageRoot:
    """Mount the box's root for the image at ``rootfs``: idmapped with the box's id maps
    (``(box id, host id, count)`` ranges), under an overlay with a tmpfs of ``size`` bytes
    above it (None: the image read-only). ``entries`` receives each staging entry as soon as
    it exists (the caller releases them in order: overlay first). ``workdir``: a directory
    to make on a writable root when the image lacks it (its ``WorkingDir``). ``seed``: a
    snapshot's subvolume the upper starts as (a fork; needs the copy-on-write store).
    ``release`` receives what must run once the mounts are gone (the upper's subvolume is
    deleted then); without it the upper is a tmpfs. Blocking."""
    uid_map = "".join(f"{b} {h} {n}\n" for b, h, n in uids)
    gid_map = "".join(f"{b} {h} {n}\n" for b, h, n in gids)
    # Host root's until its mount is made: the box's owner uid (bwrap's) gets the entry only
    # then, so nothing running as that uid can swap ``ws`` for a link root would mount on.
    merged = _new(f"{sandbox_id}.image", entries)
    lower = _new(f"{sandbox_id}.lower", entries)
    upper_fs = _new(f"{sandbox_id}.upper", entries) if size is not None else None
    try:
        source = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            ns_fd = idmap.box_userns_fd(uid_map, gid_map)
            attrs = idmap.MOUNT_ATTR_RDONLY | idmap.MOUNT_ATTR_NOSUID | idmap.MOUNT_ATTR_NODEV
            idmap.mount_tree(source, str(rootfs), str(lower), ns_fd, attrs)
        finally:
            os.close(source)
        if upper_fs is None or size is None:
            mounts.bind(str(lower), str(merged))
            mounts.read_only(str(merged))
            os.chown(merged.parent, owner, 0)
            return ImageRoot(merged, None)
        # The copy-on-write store for a caller that releases the subvolume (else a tmpfs)
        store = cowstore.root() if release is not None else None
        subvolume = None
        if store is not None:
            subvolume = _cow_upper(
                store, sandbox_id, rootfs, upper_fs, uid_map, gid_map, size, seed, release
            )
        elif seed is not None:
            raise OSError(errno.ENOTSUP, "a snapshot's upper needs the copy-on-write store")
        else:
            _tmpfs(upper_fs, f"size={size},nr_inodes={root_inodes(size)},mode=0700")
        upper, work = upper_fs / "upper", upper_fs / "work"
        if subvolume is None:
            upper.mkdir(mode=0o755)
            work.mkdir(mode=0o700)
            # The root directory of the box is the upper's: the image root's owner and
            # mode, as the box sees them (box root may make new top-level entries).
            st = os.stat(lower)
            os.chown(upper, st.st_uid, st.st_gid)  # already mapped by the idmapped lower
            upper.chmod(stat.S_IMODE(st.st_mode) & 0o1777)
        _overlay(merged, lower, upper, work)
        if workdir:  # while the entry is host root's alone: nothing can swap the path
            # made when the image lacks it, box root's, never through one of its links
            with contextlib.suppress(OSError):
                safepath.make_dirs(merged, workdir)
        os.chown(merged.parent, owner, 0)
    except OSError as exc:
        raise BackendError(
            f"policy.image: cannot mount the box's root ({exc.strerror or exc}"
            f"{' on ' + str(exc.filename) if exc.filename else ''}); corral needs root on the "
            "host and a kernel with idmapped mounts and overlayfs (Linux 5.19+)"
        ) from None
    return ImageRoot(merged, upper, subvolume)


def image_dirs(image_root: Path) -> list[str]:
    """The guest paths of an image root's top-level directories (its Landlock ``read``, and
    ``write`` too on a writable root)."""
    return [e.dest for e in image_entries(image_root) if isinstance(e, Bind)]


def image_has_file(root: Path, path: str) -> bool:
    """Whether the image has a regular file at ``path``, looked up beneath ``root`` without
    following any of the image's symlinks on the host."""
    try:
        fd = safepath.open_beneath(root, path, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def missing_in_image(image_root: Path, dests: Iterable[str]) -> frozenset[str]:
    """The guest paths of ``dests`` the image at ``image_root`` lacks, relative
    (``workspace``, ``etc/resolv.conf``): on a writable root the backend makes them in the
    overlay as the box's mount points (what is written there goes to what is mounted), not
    changes of the box (:attr:`corral.backends.base.RootLayer.mount_points`). Looked up
    beneath the image without following links."""
    made = set()
    for dest in dests:
        rel = dest.strip("/")
        if not rel:
            continue
        try:
            os.close(safepath.open_beneath(image_root, rel, os.O_PATH | os.O_NOFOLLOW))
        except OSError:
            made.add(rel)
    return frozenset(made)


def link_in_the_way(image_root: Path, dests: Iterable[str]) -> str | None:
    """A destination of ``dests`` that is, or passes through, a symlink of the image at
    ``image_root`` (``/tmp -> /etc``), or None. Each is looked up beneath the image on the
    host without following a link."""
    for dest in dests:
        rel = dest.strip("/")
        if not rel:
            continue
        try:
            fd = safepath.open_beneath(image_root, rel, os.O_PATH | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link on the way
                return dest
            continue
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):  # the destination itself
                return dest
        finally:
            os.close(fd)
    return None


def _cow_upper(
    store: Path,
    sandbox_id: str,
    rootfs: Path,
    target: Path,
    uid_map: str,
    gid_map: str,
    size: int,
    seed: Path | None,
    release: list[Callable[[], None]] | None,
) -> Path:
    """The box's upper layer as a subvolume of the copy-on-write store (a snapshot of
    ``seed``, or new: its ``upper`` taking the image root's on-disk owner and mode),
    mounted at ``target`` idmapped with the box's own maps plus :data:`MOUNTER_ID` for host
    root, nosuid, nodev. Its deletion goes into ``release`` at once (it runs after the
    mounts are gone, made or not)."""
    sub = cowstore.new_box_subvolume(store, sandbox_id, seed, size)
    if release is not None:
        release.append(lambda: cowstore.release_box(store, sandbox_id))
    if seed is None:  # nothing of a box's in it yet: made through the raw path
        st = os.stat(rootfs)
        (sub / "upper").mkdir(mode=0o755)
        (sub / "work").mkdir(mode=0o700)
        os.chown(sub / "upper", st.st_uid, st.st_gid)  # on-disk, as the image's root
        (sub / "upper").chmod(stat.S_IMODE(st.st_mode) & 0o1777)
    source = os.open(sub, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mounter = f"{MOUNTER_ID} 0 1\n"
        ns_fd = idmap.box_userns_fd(uid_map + mounter, gid_map + mounter)
        attrs = idmap.MOUNT_ATTR_NOSUID | idmap.MOUNT_ATTR_NODEV
        idmap.mount_tree(source, str(sub), str(target), ns_fd, attrs)
    finally:
        os.close(source)
    return sub


USERNS_OVERLAY_OPTIONS = "userxattr,redirect_dir=nofollow,index=off,metacopy=off,xino=off"
"""A writable root mounted inside the box's own user namespace (rootless, Linux 5.11+):
overlayfs keeps its markers in ``user.overlay.*`` xattrs there (``userxattr``), which rules
out ``redirect_dir=off``; ``nofollow`` neither makes nor follows a redirect."""

_USERNS_SCRIPT = (
    'mount -t tmpfs -o "nosuid,nodev,mode=0700,size=$1,nr_inodes=$2" corral-root "$4" '
    '&& mkdir "$4/upper" "$4/work" '
    '&& chown --reference="$3" "$4/upper" && chmod --reference="$3" "$4/upper" '
    '&& mount -t overlay -o "nosuid,nodev,lowerdir=$3,upperdir=$4/upper,workdir=$4/work,$6" '
    'corral-root "$5"'
)


def userns_root_argv(
    sh: str, lower: Path, upper_fs: Path, merged: Path, size: int, *, then_exec: bool = False
) -> list[str]:
    """The command that, run as box root inside the box's user and mount namespaces (nsenter,
    before bwrap builds the box's mounts), mounts a writable root: a tmpfs of ``size`` bytes
    at ``upper_fs`` holding the upper and work directories (the upper taking the image root's
    owner and mode), and an overlay of the image at ``lower`` at ``merged``. Both mounts live
    in the box's mount namespace alone and go with it. The image's own links are never
    followed (only ``lower`` itself, a directory of the store, is named). ValueError for a
    path overlayfs cannot take in its options (``,`` or ``:``)."""
    for path in (lower, upper_fs, merged):
        if {",", ":", "\n"} & set(str(path)):
            raise ValueError(f"{path}: overlayfs cannot take a path holding ',' or ':'")
    # ``then_exec``: the rest of the command line runs next (a rootless OCI runtime, in the
    # namespace the overlay was mounted in)
    script = _USERNS_SCRIPT + (' && shift 6 && exec "$@"' if then_exec else "")
    return [
        sh,
        "-c",
        script,
        "corral-root",
        str(size),
        str(root_inodes(size)),
        str(lower),
        str(upper_fs),
        str(merged),
        USERNS_OVERLAY_OPTIONS,
    ]
