"""Summarise a ``mutmut run`` of the core modules (``make mutate``): per module, killed (a test failed or the
mutant ran past its time limit), survived and untested mutants, and which of these are reviewed equivalent
mutants (``mutate/equivalent.json``) versus gaps in the tests.

A mutant is matched to a reviewed entry by its function and the exact changed line (before and after,
whitespace-trimmed), not by mutmut's numeric id, which shifts whenever the function's code changes.
A mutant no selected test reaches (mutmut's "no tests") is a gap like a survivor, unless reviewed.

Run from the folder where ``mutmut run`` ran (it reads ``mutmut results`` and ``mutmut show``). Prints the
counts and every gap with its diff; exits 1 when gaps are more than ``--max-gap-share`` (default 5 %) of the
non-equivalent mutants, or when some mutants were not checked (an interrupted run).
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
UNDETECTED = ("survived", "no tests", "suspicious")  # every other status is a detection (or "not checked")


def mutmut(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], capture_output=True, text=True, check=True).stdout


def diff_of(name: str) -> str:
    """``mutmut show NAME``'s diff, read in this process when mutmut's API allows (one subprocess per
    mutant costs about a second, minutes for a few hundred survivors)."""
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        module = name.split(".x", 1)[0]
        return get_diff_for_mutant(name, path=Path(*module.split(".")).with_suffix(".py"))
    except Exception:  # another mutmut version: ask its command line
        return mutmut("show", name)


def changed_lines(name: str) -> tuple[str, str]:
    """The removed and added lines of one mutant's diff, each joined and whitespace-trimmed."""
    minus, plus = [], []
    for line in diff_of(name).splitlines():
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

    undetected = sorted(n for n, s in statuses.items() if s in UNDETECTED)
    equivalent, gaps = [], []
    for name in undetected:
        before, after = changed_lines(name)
        why = reviewed.get((function_of(name), before, after))
        (equivalent if why else gaps).append((name, before, after, why))

    def module(name: str) -> str:
        return name.split(".x", 1)[0]

    counts: dict[str, int] = {}
    for s in statuses.values():
        counts[s] = counts.get(s, 0) + 1
    total = len(statuses)
    judged = total - len(equivalent)
    share = len(gaps) / judged if judged else 0.0
    print(f"mutants: {total}  " + "  ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    print(f"{'module':<20}{'mutants':>8}{'killed':>8}{'timeout':>8}{'equiv.':>8}{'gaps':>6}{'unchecked':>10}")
    for mod in sorted({module(n) for n in statuses}):
        names = [n for n in statuses if module(n) == mod]
        print(
            f"{mod:<20}{len(names):>8}{sum(statuses[n] == 'killed' for n in names):>8}"
            f"{sum(statuses[n] == 'timeout' for n in names):>8}"
            f"{sum(module(e[0]) == mod for e in equivalent):>8}{sum(module(g[0]) == mod for g in gaps):>6}"
            f"{sum(statuses[n] == 'not checked' for n in names):>10}"
        )
    print(f"not killed: {len(undetected)} = {len(equivalent)} reviewed equivalent + {len(gaps)} gaps")
    print(
        f"gaps: {len(gaps)} of {judged} non-equivalent mutants = {100 * share:.1f} % "
        f"(limit {100 * args.max_gap_share:.0f} %)"
    )
    for name, before, after, _ in gaps:
        print(f"\nGAP {name} ({statuses[name]})\n  - {before}\n  + {after}")
    unchecked = counts.get("not checked", 0)
    if unchecked:
        print(f"\n{unchecked} mutants not checked: the run was interrupted", file=sys.stderr)
    return 0 if share <= args.max_gap_share and not unchecked else 1


if __name__ == "__main__":
    sys.exit(main())
