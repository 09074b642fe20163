"""The forkserver's clean-up of a killed owner's ``pymp-*`` directory (the owner-killed case itself is in
``tests/integration/test_engine_lifecycle.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simstream.engine.forkserver_preload import remove_if_orphaned

_LISTENER_SCRIPT = """
import socket, sys
from simstream.engine.forkserver_preload import listener_directory

print(listener_directory())
with socket.socket(socket.AF_UNIX) as listener:
    listener.bind(sys.argv[1])
    listener.listen()
    print(listener_directory())
"""


def test_the_listener_directory_is_the_pymp_directory_of_a_listening_unix_socket(tmp_path):
    """In a fresh interpreter, as the forkserver is (this one may hold multiprocessing listeners of its
    own, e.g. the resource sharer's)."""
    directory = tmp_path / "pymp-test"
    directory.mkdir()
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _LISTENER_SCRIPT, str(directory / "listener-1")], capture_output=True,
        text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", str(directory)]


def test_a_directory_is_removed_only_once_its_owner_is_no_longer_the_parent(tmp_path):
    directory = tmp_path / "pymp-owner"
    directory.mkdir()
    (directory / "listener-1").write_text("")
    # the parent still lives: its directory stays (a forkserver stopped by a live owner)
    assert remove_if_orphaned(str(directory), os.getppid(), grace_s=0.05) is False
    assert directory.is_dir()
    # re-parented (the owner that started this process is gone): removed with its contents
    assert remove_if_orphaned(str(directory), owner_pid=-1) is True
    assert not directory.exists()
    # an owner that exited normally removed it already: nothing to do
    assert remove_if_orphaned(str(directory), owner_pid=-1) is False


_STOP_SCRIPT = """
import multiprocessing as mp
import os
from multiprocessing import forkserver, util

if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["simstream.engine.forkserver_preload"])
    for _ in range(2):
        process = ctx.Process(target=print, args=("served",))
        process.start()
        process.join(60)
        forkserver._forkserver._stop()  # the owner stops its forkserver and lives on
        print("kept" if os.path.isdir(util.get_temp_dir()) else "removed", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_forkserver_stopped_by_its_live_owner_leaves_the_owners_directory(tmp_path):
    script = tmp_path / "stop.py"
    script.write_text(_STOP_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["served", "kept", "served", "kept"], done.stdout + done.stderr[-3000:]
