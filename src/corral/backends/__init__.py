"""Isolation backends: each knows how to start a box that runs the guest agent, and tear it down.

:func:`backend_for` picks the backend a policy names; :func:`unavailable_reason` says, without
starting anything, why it cannot run here (used by ``corral doctor`` and the test suite).
"""

from __future__ import annotations

import importlib
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
    "oci": ("corral.backends.oci.box", "OciBackend"),
    "microvm": ("corral.backends.microvm.box", "MicroVmBackend"),
}


def backend_for(policy: Policy) -> Backend:
    """A ready backend for ``policy.backend`` (BackendUnavailable naming the fix if not)."""
    module_name, class_name = _BACKENDS[policy.backend]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise BackendUnavailable(
            f"the {policy.backend!r} backend is not part of this corral build"
        ) from None
    factory = getattr(module, class_name)
    backend: Backend = factory.for_policy(policy)
    return backend


def backend_loaded(policy: Policy) -> bool:
    """Whether ``policy``'s backend module is imported already: :func:`backend_for` is then
    cheap enough for the event loop (the first call imports it and probes the host)."""
    return _BACKENDS[policy.backend][0] in sys.modules


def unavailable_reason(policy: Policy) -> str | None:
    """Why ``policy``'s backend cannot start boxes here, or None when it can."""
    try:
        backend_for(policy)
    except BackendUnavailable as exc:
        return exc.message
    return None
