"""Re-check named mutants of a finished ``mutmut run`` against chosen tests, without a new run.

mutmut's mutated copy (``<run folder>/mutants``) switches each mutant on by the ``MUTANT_UNDER_TEST``
environment variable; this sets it per mutant and runs pytest in that folder (copy new or changed test files
into ``mutants/tests`` first). Used to confirm that a test written for a survivor kills it.

Usage, from ``<run folder>/mutants``::

    python /path/to/mutate/recheck.py "tests/pinned/test_rl.py,-k,run_rl" pbrl.learning.rl.x_run_rl__mutmut_125 ...

The first argument is the pytest arguments, comma-separated. Prints ``KILLED`` (some test failed) or
``SURVIVED`` per mutant; exits 1 when any survived.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    args, names = argv[0].split(","), argv[1:]
    survived = 0
    for name in names:
        os.environ["MUTANT_UNDER_TEST"] = name
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--rootdir=.", *args])
        survived += rc == 0
        print(f"{'SURVIVED' if rc == 0 else 'KILLED  '} {name}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
