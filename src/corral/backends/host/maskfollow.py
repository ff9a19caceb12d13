"""Masks follow the host object from one box to the next (issue 13, class 3).

A mask is laid out by path (``deny_read: [secrets/key]``), but what it protects is a host
object. A box cannot move a masked object while it is masked (the mask is a mount point:
EBUSY), but it can rename a *parent* inside a writable area (``mv secrets s2``): the mount
moves with it for that box, and the next box's mask, laid out by path, finds nothing there
and the key is readable at ``s2/key``. So, per writable area, corral records the identity
(``st_dev``/``st_ino``) of every masked object it masked there and where it was, and at the
next start:

* an object still where it was recorded costs one ``fstatat``;
* one that is not (its path is missing, is a link, or holds another object below a renamed
  parent) is searched for in the area by a walk bounded in entries and depth
  (:data:`MAX_ENTRIES`, :data:`MAX_DEPTH`), opening each directory beneath the last with
  ``O_NOFOLLOW`` (no box-made link is followed), and masked *where it is now*; the walk
  refuses the start (a PolicyError naming the path and the way out) when the bound is
  exceeded, rather than skip the mask;
* a masked file with other hard links (made by a box that saw it before it was masked, or
  inside a masked directory) is masked at each link found in the area;
* an object gone from the area (the walk saw all of it) is forgotten: nothing of it is left
  for a box to read there.

An object replaced *in place* (the same parent directories, a new inode: ``ssh-keygen``
rewriting a key) is the host's doing, not a box's (a box cannot write below a mask), and
costs no walk. Records live in the host's data directory (:func:`record_dir`), root's
0700, never in the workspace. The layout (:func:`corral.backends.layout.policy_binds`)
masks each place found as it masks the spelled path (and wherever a share shows it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral import errors
from corral.backends.host import safepath, state
from corral.backends.layout import HostView, Place, guest_path, host_path, writable_areas
from corral.policy import Policy

log = logging.getLogger(__name__)

MAX_ENTRIES = 200_000
"""Directory entries one start may read to find moved masked objects (all areas)."""
MAX_DEPTH = 64
"""Directory depth below an area's root the search goes down to."""

Ident = tuple[int, int]


Moved = dict[str, tuple[Place, ...]]
"""deny entry (as the policy spells it) -> where its objects are, besides its own path."""


def record_dir() -> Path:
    """Where the records live: ``CORRAL_DATA_DIR``, else ``/var/lib/corral`` for root
    (they must outlive a reboot, as the workspace does), else the user's data directory."""
    explicit = os.environ.get("CORRAL_DATA_DIR")
    if explicit:
        return Path(explicit, "masks")
    if os.geteuid() == 0:
        return Path("/var/lib/corral/masks")
    home = os.path.expanduser("~")
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(home, ".local", "share")
    if os.access(data, os.W_OK) or os.access(home, os.W_OK):
        return Path(data, "corral", "masks")
    return state.state_root() / "masks"


@dataclass
class _Object:
    """A file or directory to be masked, and every place it is seen from."""

    ident: Ident
    is_dir: bool
    places: list[str]
    nlink: int = 1
    parents: list[Ident] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "dev": self.ident[0],
            "ino": self.ident[1],
            "dir": self.is_dir,
            "at": self.places,
            "nlink": self.nlink,
            "parents": [list(p) for p in self.parents],
        }

    @staticmethod
    def from_json(raw: Any) -> _Object:
        return _Object(
            (int(raw["dev"]), int(raw["ino"])),
            bool(raw["dir"]),
            [str(p) for p in raw["at"]],
            int(raw.get("nlink", 1)),
            [(int(a), int(b)) for a, b in raw.get("parents", [])],
        )


def _ident(st: os.stat_result) -> Ident:
    return (st.st_dev, st.st_ino)


def _lstat_beneath(area: str, rel: str) -> os.stat_result | None:
    """The object at ``rel`` beneath ``area``, following no link (None: missing, a link on
    the way, not a directory on the way)."""
    try:
        fd = safepath.open_beneath(area, rel, os.O_PATH | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def _parents(area: str, rel: str) -> list[Ident] | None:
    """Identities of the directories between ``area`` and ``rel`` (exclusive)."""
    chain: list[Ident] = []
    parts = rel.split("/")[:-1]
    for n in range(1, len(parts) + 1):
        st = _lstat_beneath(area, "/".join(parts[:n]))
        if st is None:
            return None
        chain.append(_ident(st))
    return chain


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_ENTRIES

    def spend(self, area: str, why: str) -> None:
        self.left -= 1
        if self.left < 0:
            raise errors.PolicyError(
                f"{why}: a masked object is no longer at its path in {area} (moved by an "
                f"earlier box?) and finding it would read more than {MAX_ENTRIES} directory "
                "entries; the box was not started rather than start without the mask. Move "
                "the object back to its path (or delete it), or remove the workspace's "
                f"record in {record_dir()} if it is gone for good"
            )


def _walk(area: str, wanted: set[Ident], budget: _Budget, why: str) -> dict[Ident, list[str]]:
    """Every place below ``area`` holding one of ``wanted`` (directories opened one
    component at a time with O_NOFOLLOW, so no link is followed; mount points inside are
    crossed, as the box sees them)."""
    found: dict[Ident, list[str]] = {}
    inos = {ino for _, ino in wanted}
    root = os.open(area, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    stack: list[tuple[int, str, int]] = [(root, "", 0)]
    try:
        while stack:
            fd, rel, depth = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        budget.spend(area, why)
                        path = f"{rel}/{entry.name}" if rel else entry.name
                        if entry.is_dir(follow_symlinks=False):
                            try:
                                child = os.open(
                                    entry.name,
                                    os.O_RDONLY
                                    | os.O_DIRECTORY
                                    | os.O_NOFOLLOW
                                    | os.O_NONBLOCK
                                    | os.O_CLOEXEC,
                                    dir_fd=fd,
                                )
                            except OSError as exc:
                                if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                                    continue  # gone, or swapped for a link meanwhile
                                raise errors.PolicyError(
                                    f"{why}: a masked object is no longer at its path in "
                                    f"{area} and corral cannot search {path!a} "
                                    f"({exc.strerror}: a box may hide it there); the box was "
                                    "not started rather than start without the mask. Make it "
                                    "searchable, or move the object back to its path"
                                ) from None
                            ident = _ident(os.fstat(child))
                            if ident in wanted:
                                _refuse_unmountable(path, area, why)
                                found.setdefault(ident, []).append(path)
                            if depth + 1 >= MAX_DEPTH:
                                os.close(child)
                                raise errors.PolicyError(
                                    f"{why}: a masked object is no longer at its path in "
                                    f"{area} and {path!a} is deeper than {MAX_DEPTH} levels, "
                                    "where corral does not search; the box was not started "
                                    "rather than start without the mask. Move the object "
                                    "back to its path, or flatten that tree"
                                )
                            stack.append((child, path, depth + 1))
                        elif entry.inode() in inos:
                            try:
                                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                            except OSError:
                                continue
                            if _ident(st) in wanted and not stat.S_ISLNK(st.st_mode):
                                _refuse_unmountable(path, area, why)
                                found.setdefault(_ident(st), []).append(path)
            finally:
                os.close(fd)
    except BaseException:
        for fd, _, _ in stack:
            os.close(fd)
        raise
    return found


def _refuse_unmountable(place: str, area: str, why: str) -> None:
    """A PolicyError for a place a mask cannot be mounted at on every backend: a name that
    is not UTF-8 (an OCI config is JSON: runc and crun mangle it and fail, gVisor mounted
    the mask at another name and left the object open)."""
    try:
        place.encode()
    except UnicodeEncodeError:
        raise errors.PolicyError(
            f"{why}: the masked object now lies at {place!a} in {area} (renamed by an earlier "
            "box?), a name that is not UTF-8, where a mask cannot be laid on every backend; "
            "the box was not started. Rename it (or move it back to its path)"
        ) from None


WRITE_SCAN = 4096
"""Entries of a ``deny_write`` directory scanned per start for files with other links (a
``.git`` can hold far more: beyond, its links are not searched, and a warning says so)."""


def _inner_links(
    area: str, rel: str, budget: _Budget, why: str, cap: int | None = None
) -> tuple[list[_Object], bool]:
    """Files below the masked directory ``rel`` with more than one link (another link of
    one may be elsewhere in the area, readable or writable), and whether all were seen
    (``cap``: stop after that many entries instead of spending ``budget``)."""
    try:
        top = safepath.open_beneath(area, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
    except OSError:
        return [], True
    out: list[_Object] = []
    stack = [(top, rel, 0)]
    seen = 0
    try:
        while stack:
            fd, path, depth = stack.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        seen += 1
                        if cap is None:
                            budget.spend(area, why)
                        elif seen > cap:
                            return out, False
                        if entry.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                            try:
                                child = os.open(
                                    entry.name,
                                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK,
                                    dir_fd=fd,
                                )
                            except OSError:
                                continue
                            stack.append((child, f"{path}/{entry.name}", depth + 1))
                        elif entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            if st.st_nlink > 1:
                                place = f"{path}/{entry.name}"
                                out.append(_Object(_ident(st), False, [place], st.st_nlink))
            finally:
                os.close(fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return out, True


class _Records:
    """One JSON file per writable area (named by a hash of its real path)."""

    pruned = False
    """Whether this process has pruned the folder (once is enough)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def _file(self, area: str) -> Path:
        if self.folder is None:
            raise OSError(errno.EACCES, "every records folder lies in a writable area")
        return self.folder / (hashlib.sha256(area.encode()).hexdigest()[:32] + ".json")

    def load(self, area: str, area_ident: Ident) -> dict[str, list[_Object]]:
        try:
            fd = safepath.open_regular(self._file(area), os.O_RDONLY)
        except OSError:
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                raw = json.loads(f.read(4 << 20))
            if raw.get("area") != area or tuple(raw.get("ident", ())) != area_ident:
                return {}  # another directory at that path now: its inodes mean nothing
            return {k: [_Object.from_json(o) for o in v] for k, v in raw["entries"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def save(self, area: str, area_ident: Ident, entries: dict[str, list[_Object]]) -> None:
        path = self._file(area)
        assert self.folder is not None
        if not entries:
            path.unlink(missing_ok=True)
            return
        state.make_private_dir(self.folder)
        body = {
            "area": area,
            "ident": list(area_ident),
            "entries": {k: [o.to_json() for o in v] for k, v in entries.items()},
        }
        # One temporary file per writer: two boxes may start at once on one workspace.
        state.replace_file(path, json.dumps(body).encode())
        if not _Records.pruned:
            _Records.pruned = True
            self.prune()

    def prune(self) -> None:
        """Drop the records of areas that no longer exist (temporary workspaces)."""
        if self.folder is None:
            return
        for entry in self.folder.glob("*.json"):
            try:
                area = json.loads(entry.read_bytes()).get("area")
                if not isinstance(area, str) or not os.path.isdir(area):
                    entry.unlink()
            except (OSError, ValueError, AttributeError):
                continue


def _records(roots: list[tuple[str, Ident] | None]) -> _Records:
    """The records' folder, never inside an area the box can write (a rootless box with
    workspace = ``$HOME`` would otherwise edit ``~/.local/share/corral/masks`` and make the
    next start forget what moved): the state root then (``$XDG_RUNTIME_DIR``, lost at a
    reboot), or no folder at all."""
    areas = [root[0] for root in roots if root is not None]
    for folder in (record_dir(), state.state_root() / "masks"):
        if safepath.area_of(folder, areas) is None:
            return _Records(folder)
    return _Records(None)


def _area_of(source: str, roots: list[tuple[str, Ident] | None]) -> tuple[int, str] | None:
    """(area number, path below it) of the host path ``source``: spelled below an area, or
    one of its ancestors is an area's directory (workspace = $HOME holds ``~/.ssh``)."""
    for n, root in enumerate(roots):
        if root is not None and (source == root[0] or source.startswith(root[0] + "/")):
            return n, os.path.relpath(source, root[0])
    parent = source
    while parent not in ("/", ""):
        parent = os.path.dirname(parent)
        try:
            ident = _ident(os.stat(parent))
        except OSError:
            continue
        for n, root in enumerate(roots):
            if root is not None and root[1] == ident:
                return n, os.path.relpath(source, parent)
    return None


Entry = tuple[str, bool, int, str]
"""A deny entry in a writable area: (as spelled, deny_read?, area number, path below it)."""


def _entries(
    policy: Policy, workspace: str | os.PathLike[str], home: str | None
) -> tuple[list[tuple[str, Ident] | None], list[Entry]]:
    """The writable areas' (real path, identity) and the deny entries lying in them."""
    home = home if home is not None else os.path.expanduser("~")
    areas = writable_areas(policy, Path(workspace), home)
    roots: list[tuple[str, Ident] | None] = []
    for area in areas:
        try:
            real = os.path.realpath(area)
            roots.append((real, _ident(os.stat(real))))
        except OSError:
            roots.append(None)
    view = HostView(home=home)
    fs = policy.filesystem
    entries: list[Entry] = []
    for read, raws in ((True, fs.deny_read), (False, fs.deny_write)):
        for raw in raws:
            source = host_path(guest_path(raw, policy, view), policy, Path(workspace))
            where = _area_of(os.path.normpath(source), roots)
            if where is not None and where[1] not in (".", ""):
                entries.append((raw, read, *where))
    return roots, entries


def recheck(policy: Policy, workspace: str | os.PathLike[str], home: str | None = None) -> None:
    """Once the box is built (its masks mounted): a PolicyError unless every masked object
    is still where :func:`locate` found it. A box running on the same workspace could
    rename a parent between the search and the mount, so that the mask landed on nothing;
    after the mount the mask moves with the object (only a start can be fooled)."""
    roots, entries = _entries(policy, workspace, home)
    records = _records(roots)
    for n, root in enumerate(roots):
        mine = [e for e in entries if e[2] == n]
        if root is None or not mine:
            continue
        recorded = records.load(*root)
        for raw, read, _, rel in mine:
            for obj in recorded.get(rel, []):
                if not _still(root[0], obj):
                    field = "deny_read" if read else "deny_write"
                    raise errors.PolicyError(
                        f"filesystem.{field} {raw!r}: the masked object moved while the box "
                        "started (renamed by another box on the same workspace?), so its mask "
                        "may have missed it; the box was not started"
                    )


def masked_objects(policy: Policy, workspace: str | os.PathLike[str]) -> set[Ident]:
    """``(st_dev, st_ino)`` of every object a ``deny_read`` mask hides inside the
    workspace, wherever it lies now (:func:`locate`: renamed, hard-linked): what a copy of
    the workspace made on the host (a snapshot's) must leave out, or a box restored from
    it, under any policy, would read what this one could not."""
    locate(policy, workspace)
    roots, entries = _entries(policy, workspace, None)
    found: set[Ident] = set()
    if not roots or roots[0] is None:
        return found
    recorded = _records(roots).load(*roots[0])
    for _, read, area, rel in entries:
        if read and area == 0:
            found |= {obj.ident for obj in recorded.get(rel, [])}
            current = _lstat_beneath(roots[0][0], rel)
            if current is not None:
                found.add(_ident(current))
    return found


def locate(
    policy: Policy, workspace: str | os.PathLike[str], home: str | None = None
) -> tuple[Moved, list[str]]:
    """Where each masked object of ``policy`` lies now in its writable area, besides the
    path the policy names, and the record updated for the next start; plus warnings (an
    object gone). Raises a PolicyError when finding one would pass the walk's bounds."""
    roots, entries = _entries(policy, workspace, home)
    moved: Moved = {}
    warnings: list[str] = []
    if not entries:
        return moved, warnings
    records = _records(roots)
    budget = _Budget()
    for n, root in enumerate(roots):
        mine = [e for e in entries if e[2] == n]
        if root is not None and mine:
            _follow_area(n, root, mine, records, budget, moved, warnings)
    return moved, warnings


def _follow_area(
    n: int,
    root: tuple[str, Ident],
    mine: list[Entry],
    records: _Records,
    budget: _Budget,
    moved: Moved,
    warnings: list[str],
) -> None:
    """:func:`locate` for the entries ``mine`` of writable area ``n``."""
    area, area_ident = root
    old = records.load(area, area_ident)
    new: dict[str, list[_Object]] = {}
    wanted: dict[Ident, list[_Object]] = {}
    for raw, read, _, rel in mine:
        why = f"filesystem.{'deny_read' if read else 'deny_write'} {raw!r}"
        new[rel] = _objects(area, rel, read, old.get(rel, []), wanted, budget, why)
    if wanted:
        why = "masks " + ", ".join(sorted({repr(e[0]) for e in mine}))
        found = _walk(area, set(wanted), budget, why)
        for ident, holders in wanted.items():
            places = found.get(ident, [])
            st = _lstat_beneath(area, places[0]) if places else None
            for obj in holders:
                obj.places = list(dict.fromkeys(obj.places + places))
                if st is not None:
                    obj.nlink = st.st_nlink
                    obj.parents = _parents(area, places[0]) or []
    # Places below a masked directory are hidden with it (and no mount point can be made
    # in the mask's empty directory).
    hidden = [
        p + "/" for _, read, _, rel in mine if read for o in new[rel] if o.is_dir for p in o.places
    ]
    for raw, read, _, rel in mine:
        covered = tuple(hidden) if read else (*hidden, rel + "/")  # already read-only there
        kept = [obj for obj in new[rel] if obj.places]
        for obj in new[rel]:
            if not obj.places:
                warnings.append(
                    f"masked object of {raw!r} (inode {obj.ident[1]}) is gone from {area}: "
                    "nothing of it is left there to mask"
                )
            for place in obj.places:
                if place != rel and not place.startswith(covered):
                    moved[raw] = (*moved.get(raw, ()), Place(n, place, obj.is_dir))
        new[rel] = kept
    keep = {k: v for k, v in old.items() if k not in new}  # other policies' entries
    keep.update({k: v for k, v in new.items() if v})
    try:
        records.save(area, area_ident, keep)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES):
            raise
        warnings.append(f"masks of {area} not recorded ({exc.strerror})")


def _objects(
    area: str,
    rel: str,
    read: bool,
    prior: list[_Object],
    wanted: dict[Ident, list[_Object]],
    budget: _Budget,
    why: str,
) -> list[_Object]:
    """The objects of one mask at ``rel``: what is there now (and, for a masked directory,
    its files with other links), and those recorded before; what must be searched for is
    added to ``wanted``."""
    objects: list[_Object] = []
    current = _lstat_beneath(area, rel)
    if current is not None:
        obj = _Object(
            _ident(current),
            stat.S_ISDIR(current.st_mode),
            [rel],
            current.st_nlink,
            _parents(area, rel) or [],
        )
        objects.append(obj)
        if not obj.is_dir and obj.nlink > 1:
            wanted.setdefault(obj.ident, []).append(obj)
        if obj.is_dir:
            inner, complete = _inner_links(area, rel, budget, why, None if read else WRITE_SCAN)
            if not complete:
                log.warning(
                    "%s: more than %d entries; its files' other hard links are not searched",
                    why,
                    WRITE_SCAN,
                )
            for found in inner:
                objects.append(found)
                wanted.setdefault(found.ident, []).append(found)
    for before in prior:
        same = next((o for o in objects if o.ident == before.ident), None)
        if same is not None:
            if same.nlink == before.nlink and before.nlink > 1 and _still(area, before):
                same.places = list(dict.fromkeys(same.places + before.places))
                wanted.pop(same.ident, None)  # its links known and unchanged: no walk
            continue
        if _still(area, before):
            objects.append(before)  # where the last search found it
            continue
        if current is not None and before.places == [rel] and _replaced_in_place(area, rel, before):
            continue  # the host's new file (same parents): the old one is gone
        obj = _Object(before.ident, before.is_dir, [], before.nlink, [])
        objects.append(obj)
        wanted.setdefault(obj.ident, []).append(obj)
    return objects


def _replaced_in_place(area: str, rel: str, before: _Object) -> bool:
    """Whether another object at ``rel`` took ``before``'s place with every parent the same:
    the host's doing (``ssh-keygen`` rewrote a key). A box cannot: the mask is a mount
    point it cannot rename or write; it can only rename a parent (a new parent here)."""
    if "/" not in rel:
        return True  # right below the area's root, itself a mount point in the box
    return bool(before.parents) and before.parents == _parents(area, rel)


def _still(area: str, obj: _Object) -> bool:
    """Whether ``obj`` is still at every place recorded for it."""
    if not obj.places:
        return False
    for place in obj.places:
        st = _lstat_beneath(area, place)
        if st is None or _ident(st) != obj.ident:
            return False
    return True


def host_view(
    policy: Policy,
    workspace: str | os.PathLike[str],
    placeholder: Callable[[str, str], None] | None,
) -> HostView:
    """The :class:`HostView` a backend lays a box out with: its masks follow their objects
    (:func:`locate`; what is gone is logged)."""
    moved, warnings = locate(policy, workspace)
    for warning in warnings:
        log.warning("%s", warning)
    return HostView(moved=moved, placeholder=placeholder)
