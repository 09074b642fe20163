"""Every example in a docstring of the package runs and prints what it shows.

A newcomer copies these first; an example that no longer works is a bug. Examples that need a running
engine or a simulator carry ``# doctest: +SKIP``. The examples run in a fresh interpreter: importing every
module (the simulator, Ray) here would change what later tests' forked children inherit.
"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import doctest, importlib, pkgutil, simstream
flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
failed = attempted = 0
for info in sorted(pkgutil.walk_packages(simstream.__path__, prefix="simstream."), key=lambda i: i.name):
    if info.name.endswith("__main__"):
        continue
    result = doctest.testmod(importlib.import_module(info.name), optionflags=flags)
    failed += result.failed
    attempted += result.attempted
    if result.failed:
        print("FAILED IN", info.name)
print(f"attempted {attempted} failed {failed}")
"""


def test_docstring_examples_run():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    attempted, failed = int(last.split()[1]), int(last.split()[3])
    assert failed == 0, done.stdout[-8000:]
    assert attempted >= 19, done.stdout[-2000:]  # the examples exist (19 when this test was written)
