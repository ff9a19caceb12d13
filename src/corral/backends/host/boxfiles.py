"""Host files every box binds: a mode-000 file and directory (masks) and an /etc/passwd."""

from __future__ import annotations

from pathlib import Path

from corral.backends.host.state import state_root
from corral.backends.users import BOX_UID, passwd_text


def shared_files() -> tuple[Path, Path, Path]:
    """``(masked file, masked directory, passwd)``, made once under the state root."""
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
    if not passwd.exists():
        passwd.write_text(passwd_text(BOX_UID, BOX_UID))
    return masked_file, masked_dir, passwd
