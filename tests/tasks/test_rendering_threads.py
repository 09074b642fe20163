"""The renderer's threads in a process that renders: one llvmpipe thread, and no Mesa shader-cache writer
(its file I/O held a producer's exit for seconds on a busy machine, past the engine's shutdown bound)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RENDER_AND_LIST_THREADS = """
import json, os
from simstream.tasks import make_source
from tests.tasks.test_tasks_source import never, zero_rows
spec = make_source("pick_place", image_size=32, max_episode_steps=3)
source = spec.build(0, 0)
rows = zero_rows(spec)
source.rollout(rows, attempt=0, should_stop=never)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps({"threads": names, "image_sum": float(rows["obs", "image"].float().sum()),
                  "cache": os.environ.get("MESA_SHADER_CACHE_DISABLE")}))
source.close()
"""


def _render_in_a_fresh_process(tmp_path, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "MESA_SHADER_CACHE_DISABLE"} | env
    environment["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run(
        [sys.executable, "-c", RENDER_AND_LIST_THREADS],
        cwd=tmp_path,  # MuJoCo writes its log into the working directory
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_writers(threads: list[str]) -> list[str]:
    return [name for name in threads if ":disk$" in name]


def test_a_rendering_process_has_no_shader_cache_writer_unless_asked(tmp_path):
    default = _render_in_a_fresh_process(tmp_path)
    assert default["image_sum"] > 0  # it did render
    assert default["cache"] == "true"
    assert [name for name in default["threads"] if name.startswith("llvmpipe")] == ["llvmpipe-0"]
    assert _cache_writers(default["threads"]) == []

    asked = _render_in_a_fresh_process(tmp_path, MESA_SHADER_CACHE_DISABLE="false")
    assert asked["cache"] == "false"  # the user's choice is kept
    if not _cache_writers(asked["threads"]):
        pytest.skip("this Mesa starts no shader-cache thread even when asked: nothing to compare with")
