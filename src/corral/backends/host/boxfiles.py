"""Host files every box binds: a mode-000 file and directory (masks), and the box's own
/etc/passwd and /etc/group (``passwd`` and ``group`` side by side)."""

from __future__ import annotations

from pathlib import Path

from corral.backends.host.state import replace_file, state_root
from corral.backends.users import BOX_UID, group_text, passwd_text


def shared_files() -> tuple[Path, Path, Path]:
    """``(masked file, masked directory, passwd)``, made once under the state root; the
    box's /etc/group is ``group`` beside ``passwd``."""
    shared = state_root() / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    masked_file = shared / "masked-file"
    masked_dir = shared / "masked-dir"
    passwd = shared / "passwd"
    if not masked_file.exists():
        masked_file.touch()
    masked_file.chmod(0)
    masked_dir.mkdir(exist_ok=True)
    masked_dir.chmod(0)
    _ensure(passwd, passwd_text(BOX_UID, BOX_UID))
    _ensure(passwd.with_name("group"), group_text(BOX_UID))
    return masked_file, masked_dir, passwd


def _ensure(path: Path, text: str) -> None:
    """``path`` holds ``text`` (written whole, by rename: boxes of other processes may be
    binding it right now; a state root kept from an older corral is brought up to date)."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    replace_file(path, text.encode(), 0o644)
