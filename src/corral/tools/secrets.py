"""Secrets an operator gives to commands without the model ever seeing them.

The model names a secret with a handle, ``{{secret:my-api-key}}``; the store, filled by the
operator from ``CORRAL_SECRET_<NAME>`` environment variables or a secrets file, resolves it
only when a process starts. Every string a tool returns passes through :meth:`redact`, so a
value the program prints (or writes to a file that is read back later) comes back as
``[REDACTED:my-api-key]``; output the model reads in pieces (a shell, a running process)
is redacted across its reads (:meth:`SecretStore.redact_stream`). Redaction is textual: a
program that encodes a secret (base64, reversed) defeats it, which is why values are also
never put in tool inputs or logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from corral import errors
from corral.backends.host.safepath import open_regular

ENV_PREFIX = "CORRAL_SECRET_"
MIN_PARTIAL = 4
"""The shortest start of a value that the end of a stream redacts (see ``redact_stream``)."""
HANDLE = re.compile(r"^\{\{\s*secret:([A-Za-z0-9_.-]{1,128})\s*\}\}$")


def _key(name: str) -> str:
    """Names are matched loosely so ``my-api-key`` finds ``CORRAL_SECRET_MY_API_KEY``."""
    return name.upper().replace("-", "_").replace(".", "_")


class SecretNotFound(errors.SandboxError):
    code = errors.ErrorCode.INVALID_INPUT


class SecretStore:
    """Named secret values, plus the redaction of those values from text."""

    def __init__(self, secrets: Mapping[str, str] | None = None) -> None:
        self._values: dict[str, tuple[str, str]] = {}
        self._pattern: re.Pattern[str] | None = None
        self._names: dict[str, str] = {}
        for name, value in (secrets or {}).items():
            self.add(name, value)

    def __repr__(self) -> str:
        # Names only: a repr must never leak a value into a log or a traceback.
        return f"<SecretStore {sorted(n for n, _ in self._values.values())}>"

    def __len__(self) -> int:
        return len(self._values)

    def add(self, name: str, value: str) -> None:
        if not value:
            raise errors.SandboxError(
                f"secret {name!r} is empty", code=errors.ErrorCode.INVALID_INPUT
            )
        self._values[_key(name)] = (name, value)
        self._pattern = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SecretStore:
        """Every ``CORRAL_SECRET_<NAME>=value`` of the environment (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        return cls(
            {k[len(ENV_PREFIX) :]: v for k, v in env.items() if k.startswith(ENV_PREFIX) and v}
        )

    @classmethod
    def from_file(cls, path: str | Path) -> SecretStore:
        """A file of ``NAME=value`` lines (``#`` comments and blank lines are skipped)."""
        p = Path(path)
        try:
            fd = open_regular(p, os.O_RDONLY)  # no link, no FIFO: a regular file
            with open(fd, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise errors.PolicyError(f"cannot read secrets file {p}: {exc.strerror}") from None
        store = cls()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.partition("=")
            if not sep or not name.strip():
                # The line number only: the line itself may hold a value.
                raise errors.PolicyError(f"{p}:{number}: expected NAME=value")
            store.add(name.strip(), value.strip())
        return store

    def merged(self, other: SecretStore) -> SecretStore:
        """A store holding both; ``other`` wins on a name in both."""
        out = SecretStore()
        out._values = {**self._values, **other._values}
        return out

    def resolve(self, handles: Mapping[str, str]) -> dict[str, str]:
        """Env var name -> handle, to env var name -> value. Unknown handles are an error."""
        return {var: self.resolve_value(handle) for var, handle in handles.items()}

    def resolve_value(self, handle: str) -> str:
        m = HANDLE.match(handle)
        if m is None:
            raise errors.SandboxError(
                "secrets take handles of the form {{secret:NAME}}, not values "
                f"(got a {len(handle)}-character string)",
                code=errors.ErrorCode.INVALID_INPUT,
            )
        entry = self._values.get(_key(m.group(1)))
        if entry is None:
            known = ", ".join(sorted(n for n, _ in self._values.values())) or "none"
            raise SecretNotFound(
                f"unknown secret {m.group(1)!r}; the operator has configured: {known}"
            )
        return entry[1]

    def resolve_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """Resolve the values of ``env`` that are handles; other values pass through."""
        return {k: self.resolve_value(v) if HANDLE.match(v) else v for k, v in env.items()}

    def redact(self, text: str) -> str:
        if not self._values:
            return text
        if self._pattern is None:
            # Longest first, so a secret that contains another is replaced whole.
            values = sorted(self._values.values(), key=lambda nv: len(nv[1]), reverse=True)
            self._names = {value: name for name, value in values}
            self._pattern = re.compile("|".join(re.escape(v) for _, v in values))
        return self._pattern.sub(lambda m: f"[REDACTED:{self._names[m.group(0)]}]", text)

    def redact_stream(self, held: str, text: str, *, final: bool) -> tuple[str, str]:
        """One read of a stream that reaches the model in pieces (a shell's output since
        the last read, a running process's output so far): ``held + text`` redacted, minus
        a tail that a secret value begins with, returned second for the caller to hold and
        pass back as ``held`` on the next read. Redacting each read on its own would let a
        value printed across two reads through as two clear halves.

        ``final`` (no more output will come): nothing is held; a tail of at least
        :data:`MIN_PARTIAL` characters that begins a value is redacted, a shorter one (a
        lone ``s``) is common text and is shown.
        """
        whole = self.redact(held + text)
        start, name = self._partial_tail(whole)
        if name is None:
            return whole, ""
        if not final:
            return whole[:start], whole[start:]
        tail = whole[start:]
        return whole[:start] + (f"[REDACTED:{name}]" if len(tail) >= MIN_PARTIAL else tail), ""

    def _partial_tail(self, text: str) -> tuple[int, str | None]:
        """Where the longest tail of ``text`` that is the start of a secret value (but not
        the whole value) begins, and that secret's name; ``(len(text), None)`` if none."""
        best, found = len(text), None
        for name, value in self._values.values():
            first = value[0]
            i = text.find(first, max(0, len(text) - len(value) + 1))
            while 0 <= i < best:
                if value.startswith(text[i:]):
                    best, found = i, name
                    break
                i = text.find(first, i + 1)
        return best, found

    def redact_all(self, data: Any) -> Any:
        """Redact every string in a JSON-like structure (keys included)."""
        if not self._values:
            return data
        if isinstance(data, str):
            return self.redact(data)
        if isinstance(data, dict):
            return {self.redact_all(k): self.redact_all(v) for k, v in data.items()}
        if isinstance(data, list | tuple):
            return [self.redact_all(v) for v in data]
        return data
