"""Every Python example in the README and the RL guide runs as a script, as written."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# docs/demo.md's one example is the full demo run (minutes); tests/demo runs the same path with --quick
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "rl.md"]
EXAMPLES = {
    f"{path.stem}-{i}": code
    for path in DOCUMENTS
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))
}
TIMEOUT_S = 150

pytestmark = pytest.mark.timeout(360)


def _run(code: str, folder: Path) -> subprocess.CompletedProcess:
    script = folder / "example.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict[str, Future]:
    """Every example started at once, two at a time: each spends most of its seconds starting Python,
    torch and its producers, which two cores overlap (the module took 63 s one by one)."""
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="readme-example") as pool:
        yield {
            name: pool.submit(_run, code, tmp_path_factory.mktemp(name)) for name, code in EXAMPLES.items()
        }


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_documented_example_runs(name, example_runs):
    result = example_runs[name].result(timeout=len(EXAMPLES) * TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "an example should print what it shows"
