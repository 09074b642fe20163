"""Every Python example in the README and the RL guide runs as a script, as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# docs/demo.md's one example is the full demo run (minutes); tests/demo runs the same path with --quick
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "rl.md"]
EXAMPLES = [
    (f"{path.stem}-{i}", code)
    for path in DOCUMENTS
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))
]

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("code", [code for _, code in EXAMPLES], ids=[name for name, _ in EXAMPLES])
def test_documented_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "an example should print what it shows"
