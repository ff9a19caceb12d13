"""Render the security suite's JSON report (``CORRAL_SECURITY_REPORT``) as tables.

::

    python tests/security/report.py REPORT.json                    # print the tables
    python tests/security/report.py REPORT.json --write SECURITY.md  # refresh its table
    python tests/security/report.py --rootless SUBIDS.json ONE_ID.json --write SECURITY.md

The rootless form renders the attack suite run as the two test users (``make
test-rootless`` with ``CORRAL_ROOTLESS_REPORT``): the root column comes from the table already
in SECURITY.md, and every attack that does not run rootless is listed with its reason.

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
ROOTLESS_BEGIN = "<!-- security-report-rootless:begin -->"
ROOTLESS_END = "<!-- security-report-rootless:end -->"
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


def write_between_markers(path: Path, lines: list[str], begin: str = BEGIN, end: str = END) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + tail)


def _counts(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, int]]:
    """Outcomes per (category, backend), each test once (its last report: a rerun's)."""
    last = {row["nodeid"]: row for row in report["tests"]}
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in last.values():
        if row.get("kind") in ("attack", "exhaustion", "fault"):
            backend = row.get("backend", "-")
            if backend == "-" and "test_attack_microvm" in row["nodeid"]:
                backend = "microvm (one VM)"
            counts[(row["category"], backend)][row["outcome"]] += 1
    return counts


def root_cells(security_md: str) -> dict[tuple[str, str], str]:
    """``contained/tried`` per (category, backend) from the root table in SECURITY.md."""
    cells: dict[tuple[str, str], str] = {}
    if BEGIN not in security_md:
        return cells
    block = security_md.split(BEGIN, 1)[1].split(END, 1)[0]
    for line in block.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 7 and cols[2].isdigit():
            cells[(cols[0], cols[1])] = f"{cols[3]}/{cols[2]}"
    return cells


def _cell(c: dict[str, int] | None) -> str:
    if c is None:
        return "-"
    tried = c["passed"] + c["failed"] + c["xfailed"]
    cell = f"{c['passed']}/{tried}"
    notes = [
        f"{c['failed']} ESCAPED" if c["failed"] else "",
        f"{c['xfailed']} open" if c["xfailed"] else "",
    ]
    notes.append(f"{c['skipped']} n/a" if c["skipped"] else "")
    notes = [n for n in notes if n]
    return cell + (f" ({', '.join(notes)})" if notes else "")


def summarize_rootless(
    runs: list[tuple[str, dict[str, Any]]], root: dict[tuple[str, str], str]
) -> list[str]:
    """The attack table's rootless columns (contained/tried, n/a = skipped with a reason),
    then the reasons, grouped, for every attack that does not apply rootless."""
    counts = [(label, _counts(report)) for label, report in runs]
    order = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    keys = sorted({k for _, c in counts for k in c}, key=lambda k: (order.get(k[0], 99), k[1]))
    rows = [
        [category, backend, root.get((category, backend), "-")]
        + [_cell(c.get((category, backend))) for _, c in counts]
        for category, backend in keys
    ]
    header = ["category", "backend", "root (above)", *(f"rootless: {label}" for label, _ in runs)]
    out = _table(header, rows)
    reasons: dict[str, set[str]] = defaultdict(set)
    for _, report in runs:
        for row in report["tests"]:
            if row.get("kind") in ("attack", "exhaustion", "fault") and row["outcome"] == "skipped":
                test = row["nodeid"].split("::")[-1].split("[")[0]
                reasons[row.get("reason", "")].add(test)
    if reasons:
        out += [
            "",
            "Skipped in the rootless run, with the reason (those naming a backend are skipped "
            "in root mode too):",
            "",
        ]
        for reason, tests in sorted(reasons.items()):
            out.append(f"- {', '.join(f'`{t}`' for t in sorted(tests))}: {reason}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("report", type=Path, nargs="?")
    parser.add_argument("--write", type=Path, metavar="SECURITY_MD")
    parser.add_argument(
        "--rootless",
        type=Path,
        nargs=2,
        metavar=("SUBIDS_JSON", "ONE_ID_JSON"),
        help="the reports of the rootless run as corral-rootless and corral-nosubid",
    )
    args = parser.parse_args(argv)
    if args.rootless:
        runs = [
            (label, json.loads(path.read_text()))
            for label, path in zip(("subordinate ids", "one id"), args.rootless, strict=True)
        ]
        security_md = args.write or Path(__file__).resolve().parents[2] / "SECURITY.md"
        lines = summarize_rootless(runs, root_cells(security_md.read_text()))
        print("\n".join(lines))
        if args.write:
            write_between_markers(args.write, lines, ROOTLESS_BEGIN, ROOTLESS_END)
        reports = [r for _, r in runs]
    else:
        if args.report is None:
            parser.error("a REPORT.json, or --rootless")
        report = json.loads(args.report.read_text())
        lines = summarize(report)
        print("\n".join(lines))
        if args.write:
            write_between_markers(args.write, lines)
        reports = [report]
    escaped = sum(  # each test's last report: a rerun that passed did not escape
        1
        for report in reports
        for r in {row["nodeid"]: row for row in report["tests"]}.values()
        if r.get("kind") == "attack" and r["outcome"] == "failed"
    )
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
