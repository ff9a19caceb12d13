"""A real OCI registry on 127.0.0.1 for the tests: Debian's ``docker-registry`` (the CNCF
distribution server), storage in a temporary directory, on a free port; and ``push`` of an OCI
layout into it with skopeo. No test uses an outside registry.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REGISTRY = "/usr/bin/docker-registry"
START_SECONDS = 20.0


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    storage: Path

    def blob_path(self, digest: str) -> Path:
        hexpart = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexpart[:2] / hexpart / "data"

    def push(self, layout: Path, name: str, fmt: str = "oci") -> str:
        """Push the OCI layout's image (as an OCI or a Docker ``v2s2`` manifest); return its
        ref in this registry."""
        ref = f"{self.host}/{name}"
        subprocess.run(
            [
                "skopeo",
                "--insecure-policy",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                f"--format={fmt}",
                f"oci:{layout}",
                f"docker://{ref}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return ref


def available() -> bool:
    return os.path.exists(REGISTRY) and shutil.which("skopeo") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_registry(tmp: Path) -> Iterator[Registry]:
    """Start the registry and wait for its "listening on" log line (bounded)."""
    port = _free_port()
    storage = tmp / "storage"
    storage.mkdir()
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: info, formatter: text}\n"
        f"storage: {{filesystem: {{rootdirectory: {storage}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    proc = subprocess.Popen(
        [REGISTRY, "serve", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + START_SECONDS
        seen = b""
        while b"listening on" not in seen:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stderr], [], [], max(left, 0))
            chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
            if not chunk:
                raise RuntimeError(f"docker-registry did not start: {seen.decode()[-2000:]}")
            seen += chunk
        # Keep draining its log so it never blocks on a full pipe.
        drain = subprocess.Popen(["cat"], stdin=proc.stderr, stdout=subprocess.DEVNULL)
        try:
            yield Registry(f"127.0.0.1:{port}", storage)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            drain.wait(timeout=10)
            proc.stderr.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
