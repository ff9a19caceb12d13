"""Isolation backends: each knows how to start a box that runs the guest agent, and tear it down.

:func:`backend_for` picks the backend a policy names; :func:`unavailable_reason` says, without
starting anything, why it cannot run here (used by ``corral doctor`` and the test suite).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from corral.errors import BackendUnavailable

if TYPE_CHECKING:
    from corral.backends.base import Backend
    from corral.policy import Policy

# policy.backend -> (module, class). Modules are imported on demand: a host without qemu
# never loads the microVM code.
_BACKENDS: dict[str, tuple[str, str]] = {
    "bwrap": ("corral.backends.bwrap.box", "BwrapBackend"),
    "bwrap-rootless": ("corral.backends.bwrap.rootless", "RootlessBwrapBackend"),
    "oci": ("corral.backends.oci.box", "OciBackend"),
    "microvm": ("corral.backends.microvm.box", "MicroVmBackend"),
}


def effective_backend(policy: Policy) -> str:
    """The backend that runs ``policy``'s boxes: ``bwrap`` is ``bwrap-rootless`` when corral
    is not root (an ordinary user: its boxes need no privilege, see
    :mod:`corral.backends.bwrap.rootless`)."""
    if policy.backend == "bwrap" and os.geteuid() != 0:
        return "bwrap-rootless"
    return policy.backend


def backend_for(policy: Policy) -> Backend:
    """A ready backend for ``policy.backend`` (BackendUnavailable naming the fix if not)."""
    name = effective_backend(policy)
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise BackendUnavailable(f"the {name!r} backend is not part of this corral build") from None
    factory = getattr(module, class_name)
    backend: Backend = factory.for_policy(policy)
    return backend


def backend_loaded(policy: Policy) -> bool:
    """Whether ``policy``'s backend module is imported already: :func:`backend_for` is then
    cheap enough for the event loop (the first call imports it and probes the host)."""
    return _BACKENDS[effective_backend(policy)][0] in sys.modules


def unavailable_reason(policy: Policy) -> str | None:
    """Why ``policy``'s backend cannot start boxes here, or None when it can."""
    try:
        backend_for(policy)
    except BackendUnavailable as exc:
        return exc.message
    return None
