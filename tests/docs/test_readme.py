"""Every Python example in the README runs as a script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"example-{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "an example should print what it shows"
