"""Summarise a ``mutmut run`` of the core modules (``make mutate``): killed, survived, and which survivors
are reviewed equivalent mutants (``mutate/equivalent.json``) versus gaps in the tests.

A mutant is matched to a reviewed entry by its function and the exact changed line (before and after,
whitespace-trimmed), not by mutmut's numeric id, which shifts whenever the function's code changes.

Run from the folder where ``mutmut run`` ran (it reads ``mutmut results`` and ``mutmut show``). Prints the
counts and every gap with its diff; exits 1 when gaps are more than ``--max-gap-share`` (default 5 %) of the
non-equivalent mutants.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATUS = re.compile(r"^\s*(?P<name>\S+): (?P<status>.+)$")


def mutmut(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], capture_output=True, text=True,
                          check=True).stdout


def changed_lines(name: str) -> tuple[str, str]:
    """The removed and added lines of one mutant's diff, each joined and whitespace-trimmed."""
    minus, plus = [], []
    for line in mutmut("show", name).splitlines():
        if line.startswith("-") and not line.startswith("---"):
            minus.append(line[1:].strip())
        elif line.startswith("+") and not line.startswith("+++"):
            plus.append(line[1:].strip())
    return " ".join(minus), " ".join(plus)


def function_of(name: str) -> str:
    return name.rsplit("__mutmut_", 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-gap-share", type=float, default=0.05)
    parser.add_argument("--equivalent", type=Path, default=HERE / "equivalent.json")
    args = parser.parse_args()

    statuses: dict[str, str] = {}
    for line in mutmut("results", "--all", "true").splitlines():
        m = STATUS.match(line)
        if m:
            statuses[m["name"]] = m["status"].strip()
    if not statuses:
        print("no mutmut results here: run `mutmut run` first", file=sys.stderr)
        return 2
    reviewed = {(e["function"], e["from"], e["to"]): e["why"] for e in json.loads(args.equivalent.read_text())}

    survivors = sorted(n for n, s in statuses.items() if s == "survived")
    equivalent, gaps = [], []
    for name in survivors:
        before, after = changed_lines(name)
        why = reviewed.get((function_of(name), before, after))
        (equivalent if why else gaps).append((name, before, after, why))

    counts: dict[str, int] = {}
    for s in statuses.values():
        counts[s] = counts.get(s, 0) + 1
    total = len(statuses)
    judged = total - len(equivalent)
    share = len(gaps) / judged if judged else 0.0
    print(f"mutants: {total}  " + "  ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"survived: {len(survivors)} = {len(equivalent)} reviewed equivalent + {len(gaps)} gaps")
    print(f"gaps: {len(gaps)} of {judged} non-equivalent mutants = {100 * share:.1f} % "
          f"(limit {100 * args.max_gap_share:.0f} %)")
    for name, before, after, _ in gaps:
        print(f"\nGAP {name}\n  - {before}\n  + {after}")
    return 0 if share <= args.max_gap_share else 1


if __name__ == "__main__":
    sys.exit(main())
