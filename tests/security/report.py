"""Render the security suite's JSON report (``CORRAL_SECURITY_REPORT``) as tables.

::

    python tests/security/report.py REPORT.json                    # print the tables
    python tests/security/report.py REPORT.json --write SECURITY.md  # refresh its table

Counts come from the test outcomes: an attack is *contained* when its test passed; a strict
``xfail`` is a known, documented gap (``open``); a skip means the backend is not available.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BEGIN = "<!-- security-report:begin -->"
END = "<!-- security-report:end -->"
CATEGORY_ORDER = (
    "filesystem",
    "privilege",
    "processes",
    "terminal",
    "network",
    "protocol",
    "exhaustion",
    "faults",
)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def summarize(report: dict[str, Any]) -> list[str]:
    """Markdown tables: attacks per category and backend, responsiveness, leak figures."""
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in report["tests"]:
        if row.get("kind") not in ("attack", "exhaustion", "fault"):
            continue
        counts[(row["category"], row.get("backend", "-"))][row["outcome"]] += 1
    order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    rows = []
    totals: dict[str, int] = defaultdict(int)
    for (category, backend), c in sorted(
        counts.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])
    ):
        tried = c["passed"] + c["failed"] + c["xfailed"]
        rows.append(
            [
                category,
                backend,
                str(tried),
                str(c["passed"]),
                str(c["xfailed"]),
                str(c["failed"]),
                str(c["skipped"]),
            ]
        )
        for key in ("passed", "failed", "xfailed", "skipped"):
            totals[key] += c[key]
        totals["tried"] += tried
    rows.append(
        [
            "**total**",
            "",
            str(totals["tried"]),
            str(totals["passed"]),
            str(totals["xfailed"]),
            str(totals["failed"]),
            str(totals["skipped"]),
        ]
    )
    out = _table(
        [
            "category",
            "backend",
            "attacks tried",
            "contained",
            "open (known gap)",
            "escaped",
            "skipped",
        ],
        rows,
    )
    figures = report.get("figures", [])
    resp = [f for f in figures if f.get("kind") == "responsiveness"]
    if resp:
        out += ["", "Latency of `true` in a second sandbox while the attack runs (ms):", ""]
        out += _table(
            ["attack", "backend", "baseline median", "during: median", "during: max", "samples"],
            [
                [
                    f["attack"],
                    f["backend"],
                    str(f["baseline_ms"]),
                    str(f["median_ms"]),
                    str(f["max_ms"]),
                    str(f["samples"]),
                ]
                for f in resp
            ],
        )
    leaks = [f for f in figures if f.get("kind") in ("leaks", "output_flood")]
    if leaks:
        out += ["", "Leak and flood figures:", ""]
        for f in leaks:
            details = ", ".join(f"{k}={v}" for k, v in f.items() if k != "kind")
            out.append(f"- {f['kind']}: {details}")
    return out


def write_between_markers(path: Path, lines: list[str]) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("report", type=Path)
    parser.add_argument("--write", type=Path, metavar="SECURITY_MD")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    lines = summarize(report)
    print("\n".join(lines))
    if args.write:
        write_between_markers(args.write, lines)
    escaped = sum(
        1 for r in report["tests"] if r.get("kind") == "attack" and r["outcome"] == "failed"
    )
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
