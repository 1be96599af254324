"""Run mypy and fail on any error that is not in the committed baseline (``tools/mypy_baseline.txt``).

The baseline is empty: mypy passes on ``swarm/`` and ``peers/`` at the strictness in pyproject.toml, so any
error fails the run. The mechanism stays for an upgrade of mypy or of a dependency's stubs that brings errors
which cannot all be fixed at once: listed as ``path: message [code]`` (no line numbers, so that an edit
elsewhere in a file does not move them), they are tolerated until fixed, and a fixed one is reported so that
the list only shrinks (``--update`` rewrites it from the current errors).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tools" / "mypy_baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:]+):\d+(?::\d+)?: error: (?P<message>.*)$")


def current_errors(mypy: str) -> List[str]:
    """mypy's errors on the project, as baseline keys; exits with mypy's output when mypy itself fails."""
    done = subprocess.run([mypy, "--no-error-summary", "--show-error-codes"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode not in (0, 1):
        sys.exit(f"mypy failed to run (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    keys = []
    for line in done.stdout.splitlines():
        match = _ERROR.match(line)
        if match:
            keys.append(f"{match['path']}: {match['message']}")
    return keys


def main(argv: List[str]) -> int:
    mypy = str(Path(sys.executable).with_name("mypy"))
    errors = Counter(current_errors(mypy))
    if "--update" in argv:
        BASELINE.write_text("".join(f"{key}\n" for key in sorted(errors.elements())))
        print(f"mypy baseline: {sum(errors.values())} known errors written to {BASELINE.relative_to(ROOT)}")
        return 0
    known = Counter(line for line in BASELINE.read_text().splitlines() if line.strip())
    new, fixed = errors - known, known - errors
    for key in sorted(new.elements()):
        print(f"new type error: {key}")
    if fixed:
        print(f"mypy: {sum(fixed.values())} known errors are fixed: shrink the baseline "
              f"(python tools/mypy_baseline.py --update)")
    print(f"mypy: {sum(errors.values())} errors, {sum(new.values())} not in the baseline of {sum(known.values())}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
