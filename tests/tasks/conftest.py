"""Run every task test module from a temporary directory: MuJoCo writes MUJOCO_LOG.TXT into the cwd."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def _mujoco_tmp_cwd(tmp_path_factory):
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("mujoco_cwd"))
    try:
        yield
    finally:
        os.chdir(previous)
