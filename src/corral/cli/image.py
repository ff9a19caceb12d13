"""``corral image pull|ls|inspect|rm|build``: the host's image store (registered by corral.cli).

::

    corral image pull 127.0.0.1:5000/tools:1     # from a registry (skopeo), unpacked by layer
    corral image pull ./layout:v1                # an OCI layout dir, OCI archive or docker save
    corral image ls                              # what is stored
    corral image inspect tools:1                 # its digest, config, layers and root (JSON)
    corral image rm 127.0.0.1:5000/tools:1       # forget it; layers no image uses are dropped
    corral image build -t tools:2 ./ctx          # FROM, RUN, COPY, ENV, WORKDIR...

A ref is normalised as docker does (``busybox`` is ``docker.io/library/busybox:latest``);
``inspect`` and ``rm`` also take a digest or a 12+ digit prefix of one. Errors are one line
with a stable code (``image_not_found``, ``digest_mismatch``, ``corrupt_layer``,
``unsafe_layer``, ``image_too_large``...), or a JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import TYPE_CHECKING, Any

from corral import errors
from corral.cli.options import terminal_safe

__all__ = ["register"]

if TYPE_CHECKING:
    from corral.images.store import ImageRecord, ImageStore
    from corral.policy import Policy

    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def register(sub: SubParsers) -> None:
    from corral.net.cli import add_network_options

    image = sub.add_parser("image", help="pull, list, inspect and remove box images")
    isub = image.add_subparsers(dest="image_cmd", required=True, metavar="ACTION")

    pull = isub.add_parser("pull", help="pull an image from a registry, or import a local one")
    pull.add_argument("ref", metavar="REF", help="REGISTRY/NAME[:TAG][@DIGEST] or a PATH[:TAG]")
    tls = pull.add_mutually_exclusive_group()
    tls.add_argument(
        "--tls-verify",
        dest="tls_verify",
        action="store_true",
        default=None,
        help="require HTTPS with a valid certificate (the default, except for a registry on "
        "localhost or 127.0.0.0/8)",
    )
    tls.add_argument(
        "--no-tls-verify", dest="tls_verify", action="store_false", help="allow plain HTTP"
    )
    pull.add_argument("--json", action="store_true")
    pull.set_defaults(func=cmd_pull)

    ls = isub.add_parser("ls", help="list the stored images")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    inspect = isub.add_parser("inspect", help="show an image's digest, config and layers (JSON)")
    inspect.add_argument("ref", metavar="REF")
    inspect.add_argument("--json", action="store_true", help="(the output is always JSON)")
    inspect.set_defaults(func=cmd_inspect)

    build = isub.add_parser(
        "build", help="build an image from a Dockerfile subset (FROM, RUN, COPY, ENV, WORKDIR...)"
    )
    build.add_argument("context", metavar="CONTEXT", help="the build context directory")
    build.add_argument("-t", "--tag", required=True, metavar="REF", help="the new image's ref")
    build.add_argument("-f", "--file", metavar="DOCKERFILE", help="default: CONTEXT/Dockerfile")
    build.add_argument(
        "--root-size",
        metavar="SIZE",
        help="the writable root of each RUN box (filesystem.root_size; default 1G)",
    )
    build.add_argument("--memory", metavar="SIZE", help="memory limit of each RUN box")
    add_network_options(build)  # RUN boxes have no network unless these say
    build.add_argument("--json", action="store_true")
    build.set_defaults(func=cmd_build)

    rm = isub.add_parser("rm", help="remove images; layers no other image uses are dropped")
    rm.add_argument("refs", nargs="+", metavar="REF")
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(func=cmd_rm)


def _store() -> ImageStore:
    from corral.images.store import ImageStore

    return ImageStore()


def _summary(store: ImageStore, record: ImageRecord) -> dict[str, Any]:
    return {
        "ref": record.ref,
        "digest": record.digest,
        "source": record.source,
        "layers": len(record.layers),
        "size": record.size,
        "created": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
        "rootfs": str(store.rootfs(record)),
    }


def _lookup(store: ImageStore, ref: str) -> ImageRecord:
    """By what was typed (a digest, a stored ref), then as a normalised registry ref."""
    from corral.images.registry import parse_ref
    from corral.images.store import is_path, split_path_tag

    try:
        return store.find(ref)
    except errors.ImageNotFound:
        pass
    if is_path(ref):
        path, tag = split_path_tag(ref)
        for kind in ("oci-layout", "archive"):
            record = store.get(f"{kind}:{path.resolve()}" + (f":{tag}" if tag else ""))
            if record is not None:
                return record
    else:
        try:
            record = store.get(str(parse_ref(ref)))
        except errors.ImageError:
            record = None
        if record is not None:
            return record
    raise errors.ImageNotFound(f"no image {ref!r} in the store (see corral image ls)")


def cmd_pull(args: argparse.Namespace) -> int:
    from corral.images.store import is_path

    store = _store()
    if is_path(args.ref):
        record = store.add_path(args.ref)
        if record is None:
            raise errors.ImageError(
                f"{args.ref} is a directory but no OCI image layout (a plain root directory "
                "needs no pull: use it as the image as it is)",
                code=errors.ErrorCode.INVALID_INPUT,
            )
    else:
        record = store.pull(args.ref, tls_verify=args.tls_verify)
    summary = _summary(store, record)
    if args.json:
        print(json.dumps(summary))
    else:
        print(terminal_safe(f"{record.ref} {record.digest}", sys.stdout, args))
    return 0


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1000
    return f"{n}B"


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store()
    rows = [_summary(store, r) for r in store.list()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("REF", "DIGEST", "LAYERS", "SIZE", "SOURCE")]
    for row in rows:
        digest = str(row["digest"]).removeprefix("sha256:")[:12]
        table.append((row["ref"], digest, str(row["layers"]), _size(row["size"]), row["source"]))
    width = max(len(r[0]) for r in table)
    for r in table:
        line = f"{r[0]:<{width}}  {r[1]:<12}  {r[2]:>6}  {r[3]:>8}  {r[4]}"
        print(terminal_safe(line, sys.stdout, args))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _store()
    record = _lookup(store, args.ref)
    data = _summary(store, record)
    data.update(
        config_digest=record.config_digest,
        layers=list(record.layers),
        config=record.config,
        architecture=record.architecture,
        os=record.os,
    )
    print(terminal_safe(json.dumps(data, indent=2), sys.stdout, args))
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from corral.images.build import build

    context = Path(args.context)
    if not context.is_dir():
        raise errors.ImageError(
            f"the build context {context} is not a directory", code=errors.ErrorCode.INVALID_INPUT
        )
    dockerfile = Path(args.file) if args.file else context / "Dockerfile"
    try:
        text = dockerfile.read_text()
    except OSError as exc:
        raise errors.ImageError(
            f"cannot read {dockerfile}: {exc.strerror}", code=errors.ErrorCode.INVALID_INPUT
        ) from None
    store = _store()

    def log(text: str) -> None:  # what RUN steps print, as docker build shows it
        sys.stderr.write(terminal_safe(text, sys.stderr, args))
        sys.stderr.flush()

    record = build(store, text, context, args.tag, log=log, policy=_run_policy(args))
    if args.json:
        print(json.dumps(_summary(store, record)))
    else:
        print(terminal_safe(f"{record.ref} {record.digest}", sys.stdout, args))
    return 0


def _run_policy(args: argparse.Namespace) -> Policy:
    """The policy of a build's RUN boxes, from ``--root-size``, ``--memory`` and the network
    options."""
    from corral.net.cli import apply_network_options
    from corral.policy import Policy

    data: dict[str, Any] = {}
    if args.root_size:
        data["filesystem"] = {"root_size": args.root_size}
    if args.memory:
        data["limits"] = {"memory_bytes": args.memory}
    return apply_network_options(Policy.from_dict(data), args)


def cmd_rm(args: argparse.Namespace) -> int:
    store = _store()
    records = {r.ref: r for r in (_lookup(store, ref) for ref in args.refs)}  # all or none
    removed = [store.remove(ref).ref for ref in records]
    if args.json:
        print(json.dumps({"removed": removed}))
    else:
        for ref in removed:
            print(terminal_safe(f"removed {ref}", sys.stdout, args))
    return 0
