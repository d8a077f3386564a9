"""Pass/fail counts of two pytest runs (junit XML) of one selection, and the tests whose outcome differs.

    python scripts/peer/compare_runs.py without.xml with.xml [--label-a "without Lagom" --label-b "with Lagom"]

A test's outcome is the worst of its phases as pytest's junit XML records them: failed (the test
body), errored (setup or teardown, or the module failed to collect), skipped, passed. Exit status 0:
the comparison is a report, not a verdict; the lists say what Lagom changed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass

OUTCOMES = ("passed", "failed", "errored", "skipped")


@dataclass
class Result:
    outcome: str
    message: str  # first line of the failure, error or skip message; empty when passed


def _message(node: ET.Element) -> str:
    text = (node.get("message") or node.text or "").strip()
    return text.splitlines()[0][:300] if text else ""


def read_junit(path: str) -> dict[str, Result]:
    """Test id (``file::Class::name`` where the XML allows) -> its outcome."""
    results: dict[str, Result] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None:
            result = Result("failed", _message(failure))
        elif error is not None:
            result = Result("errored", _message(error))
        elif skipped is not None:
            result = Result("skipped", _message(skipped))
        else:
            result = Result("passed", "")
        results[test_id] = result
    return results


def table(runs: dict[str, dict[str, Result]]) -> str:
    width = max(len(label) for label in runs)
    lines = [f"{'run':<{width}}  {'collected':>9}  " + "  ".join(f"{o:>7}" for o in OUTCOMES)]
    for label, results in runs.items():
        counts = Counter(r.outcome for r in results.values())
        lines.append(f"{label:<{width}}  {len(results):>9}  " + "  ".join(f"{counts[o]:>7}" for o in OUTCOMES))
    return "\n".join(lines)


def differences(a: dict[str, Result], b: dict[str, Result]) -> list[tuple[str, str, str, str]]:
    """(test, outcome in a, outcome in b, b's message) for every test whose outcome differs."""
    rows = []
    for test_id in sorted(set(a) | set(b)):
        ra, rb = a.get(test_id), b.get(test_id)
        oa = ra.outcome if ra else "absent"
        ob = rb.outcome if rb else "absent"
        if oa != ob:
            rows.append((test_id, oa, ob, rb.message if rb else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_a")
    parser.add_argument("junit_b")
    parser.add_argument("--label-a", default="without Lagom")
    parser.add_argument("--label-b", default="with Lagom")
    args = parser.parse_args(argv)
    a, b = read_junit(args.junit_a), read_junit(args.junit_b)
    print(table({args.label_a: a, args.label_b: b}))
    rows = differences(a, b)
    print(f"\n{len(rows)} tests differ ({args.label_a} -> {args.label_b}):")
    for test_id, oa, ob, message in rows:
        print(f"  {oa:>7} -> {ob:<7} {test_id}" + (f"\n            {message}" if message else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
