"""The lock-free readers refuse a CPU whose memory model they were not written for, before anything is
allocated, unless the user opts out. The CPU is faked (``platform.machine``): these tests run on x86-64,
where the refusal cannot happen otherwise."""

from __future__ import annotations

import platform

import pytest

from simstream import OnlineDataEngine
from simstream._memory_order import ALLOW_WEAK_MEMORY_ORDER, require_ordered_memory
from simstream.rl import APPOConfig, APPORunner
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)

MESSAGE = "relies on x86's memory ordering; this CPU is 'aarch64'"


@pytest.fixture
def arm64(monkeypatch):
    monkeypatch.delenv(ALLOW_WEAK_MEMORY_ORDER, raising=False)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    return monkeypatch


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "i686"])
def test_x86_machines_start(monkeypatch, machine):
    monkeypatch.delenv(ALLOW_WEAK_MEMORY_ORDER, raising=False)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    require_ordered_memory("OnlineDataEngine")


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", ""])
def test_other_machines_are_refused_with_the_way_out(monkeypatch, machine):
    monkeypatch.delenv(ALLOW_WEAK_MEMORY_ORDER, raising=False)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with pytest.raises(RuntimeError) as raised:
        require_ordered_memory("OnlineDataEngine")
    message = str(raised.value)
    assert message.startswith("OnlineDataEngine reads shared memory without locks")
    assert f"this CPU is {machine or 'unknown'!r}" in message
    assert f"Set {ALLOW_WEAK_MEMORY_ORDER}=1 to start anyway" in message


def test_the_engine_is_refused_before_anything_is_allocated(arm64):
    cfg = make_cfg(ScriptedSpec())
    with pytest.raises(RuntimeError, match=f"^OnlineDataEngine .*{MESSAGE}"):
        OnlineDataEngine(cfg)
    arm64.setenv(ALLOW_WEAK_MEMORY_ORDER, "1")
    engine = OnlineDataEngine(cfg)  # opted out: constructed (never started)
    assert engine.state.name == "CREATED"


def test_only_the_value_1_opts_out(arm64):
    arm64.setenv(ALLOW_WEAK_MEMORY_ORDER, "yes")
    with pytest.raises(RuntimeError, match=MESSAGE):
        require_ordered_memory("OnlineDataEngine")


def _appo(mode: str) -> APPOConfig:
    return APPOConfig(
        env_id="Pendulum-v1", num_envs=1, steps_per_rollout=16, minibatch_size=16, num_epochs=1,
        hidden_sizes=(16,), mode=mode,
    )  # fmt: skip


def test_an_async_runner_is_refused_before_its_collector_starts(arm64, tmp_path):
    with APPORunner(_appo("async")) as runner:
        with pytest.raises(RuntimeError, match=r"^APPORunner \(mode='async'\) reads shared memory"):
            runner.learn(1, log_dir=str(tmp_path))
        assert runner.ring is None and runner.weights is None  # nothing was allocated


def test_a_serial_runner_shares_nothing_across_processes_and_runs(arm64, tmp_path):
    with APPORunner(_appo("serial")) as runner:
        runner.learn(1, log_dir=str(tmp_path))
        assert runner.iterations_done == 1
