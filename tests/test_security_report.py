"""tests/security/report.py's rootless form: SECURITY.md's rootless columns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from security import report

ROOT_BLOCK = f"""{report.BEGIN}
| category | backend | attacks tried | contained | open (known gap) | escaped | skipped |
|---|---|---|---|---|---|---|
| privilege | bwrap | 3 | 3 | 0 | 0 | 0 |
{report.END}

{report.ROOTLESS_BEGIN}
{report.ROOTLESS_END}
"""


def _row(test: str, outcome: str, reason: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"nodeid": f"tests/security/t.py::{test}[bwrap]", "outcome": outcome}
    row |= {"kind": "attack", "category": "privilege", "backend": "bwrap"}
    return row | ({"reason": reason} if reason else {})


def test_the_rootless_columns_and_their_reasons(tmp_path: Path) -> None:
    md = tmp_path / "SECURITY.md"
    md.write_text(ROOT_BLOCK)
    subids = [_row("a", "failed"), _row("a", "passed"), _row("b", "passed"), _row("c", "passed")]
    one_id = [_row("a", "passed"), _row("b", "passed"), _row("c", "skipped", "rootless, one id: x")]
    paths = []
    for name, rows in (("s", subids), ("o", one_id)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"tests": rows, "figures": []}))
    assert report.main(["--rootless", *map(str, paths), "--write", str(md)]) == 0
    text = md.read_text()
    # the rerun's pass counts once; the root column is read from the block above
    assert "| privilege | bwrap | 3/3 | 3/3 | 2/2 (1 n/a) |" in text
    assert "- `c`: rootless, one id: x" in text
    one_id[0]["outcome"] = "failed"  # an attack that got through fails the command
    paths[1].write_text(json.dumps({"tests": one_id, "figures": []}))
    assert report.main(["--rootless", *map(str, paths)]) == 1
