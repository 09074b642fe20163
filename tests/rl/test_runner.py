"""The runner through real spawned collectors: lifecycle, modes, ring policies, checkpoints, CLI, learning."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from simstream._runs import FOLDER_NAME_RULE
from simstream.rl import APPOConfig, APPORunner, CollectorDiedError, RunnerConfig
from simstream.rl.ring import READY, WRITING
from tests.rl.collectors import ToyRunner
from tests.rl.fault_env import env_id
from tests.support.processes import wait_for_exit

pytestmark = pytest.mark.timeout(120)


def _tiny(**overrides) -> APPOConfig:
    base = dict(
        env_id=env_id("none"), num_envs=2, steps_per_rollout=16, minibatch_size=16, num_epochs=2,
        hidden_sizes=(16,), stats_window=2, runner=RunnerConfig(shutdown_timeout_s=10.0),
    )  # fmt: skip
    return APPOConfig(**{**base, **overrides})


def test_toy_runner_lifecycle_context_manager_and_idempotent_close():
    with ToyRunner() as runner:
        assert runner.learn(20) >= 20
        pid = runner.collector_pid
        assert pid is not None and runner._process().is_alive()
    first = runner.last_close_report
    assert first.clean and first.exitcode == 0 and first.released == 1
    assert runner.resource.released == 1
    assert runner.close() is first  # idempotent: the same report, nothing released twice
    assert runner.resource.released == 1
    assert mp.active_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        runner.learn(1)


def _lock_files() -> int:
    """This process's descriptors of simstream's shared-lock files (memfds named ``simstream-lock``)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:simstream-lock")
        except FileNotFoundError:  # closed meanwhile (the listing's own descriptor, a thread's file)
            pass
    return count


def test_a_closed_runner_that_is_kept_holds_no_lock_file_of_its_collector():
    before = _lock_files()
    runner = ToyRunner()
    runner.learn(2)
    assert _lock_files() > before  # the error channel's lock, at least
    runner.close()
    assert _lock_files() == before and runner.collector_pid is None


def test_ctrl_c_is_left_to_the_learner():
    """SIGINT goes to the whole process group; the collector ignores it and stops through close()."""
    import signal

    with ToyRunner() as runner:
        runner.learn(5)
        os.kill(runner.collector_pid, signal.SIGINT)
        assert runner.learn(30) >= 30
    assert runner.last_close_report.clean


def test_close_before_start_is_clean():
    runner = ToyRunner()
    report = runner.close()
    assert report.clean and report.exitcode is None and report.released == 1


@pytest.mark.parametrize("overflow", ["block", "drop_oldest"])
def test_ring_reader_never_sees_a_torn_rollout_across_processes(overflow):
    from simstream.rl import RolloutRing
    from tests.rl.collectors import hammer_ring

    ctx = mp.get_context("spawn")
    ring = RolloutRing({"x": ((32,), torch.float32)}, 2, overflow, ctx)
    writer = ctx.Process(target=hammer_ring, args=(ring, 200), daemon=True)
    writer.start()
    seen, last_seq = 0, -1
    try:
        while writer.is_alive() or ring.states().count(2):
            taken = ring.take(2)
            if not taken:
                ring.wait_filled(0.05)
                continue
            data = ring.gather(taken)["x"]
            ring.free(taken)
            for row, t in zip(data, taken):
                assert torch.all(row == t.version), "torn read"  # every element from the same rollout
                assert t.seq > last_seq
                last_seq = t.seq
                seen += 1
    finally:
        writer.join(30)
    assert writer.exitcode == 0
    stats = ring.stats()
    assert seen == stats.consumed and stats.committed == 200
    assert seen + stats.dropped_overflow == 200
    if overflow == "block":
        assert stats.dropped_overflow == 0


def test_sync_mode_matches_serial_mode_exactly():
    """Lock-step with a subprocess is the same computation as collecting in-process (A/B equivalence)."""
    rows = {}
    assert _tiny().normalize_obs
    for mode in ("sync", "serial"):
        with APPORunner(_tiny(mode=mode)) as runner:
            runner.learn(4, log_dir=None)
            rows[mode] = [
                {
                    k: None if v != v else v
                    for k, v in r.items()
                    if not k.endswith("_s") and k != "rl/env_frames"
                }
                for r in runner.history
            ]
            assert all(r["rl/policy_lag"] == 0 for r in runner.history)
            # in lock-step the behaviour policy is the target policy, normaliser included: rho is 1
            assert all(r["vtrace/rho_clip_fraction"] == 0.0 for r in runner.history)
            assert all(r["vtrace/rho_p99"] == pytest.approx(1.0, abs=1e-5) for r in runner.history)
    assert rows["sync"] == rows["serial"]


def test_async_policy_lag_cap_drops_stale_rollouts_and_counts_them():
    with APPORunner(_tiny(max_policy_lag=0, num_slots=3)) as runner:
        summary = runner.learn(12, log_dir=None)
    assert summary["status"] == "completed" and summary["iterations"] == 12
    assert summary["dropped_stale"] > 0
    assert all(r["rl/policy_lag"] == 0 for r in runner.history)


def _wait_for_a_slot(runner: APPORunner, state: int, failure: str) -> None:
    """Until a slot of the runner's ring is in ``state``: a bounded poll (nothing tells when the collector
    claims or commits one)."""
    deadline = time.monotonic() + 60
    while state not in runner.ring.states():
        assert time.monotonic() < deadline, failure
        threading.Event().wait(0.001)


@pytest.mark.parametrize("mode", ["sync", "serial"])
def test_a_lock_step_rollout_older_than_the_lag_cap_after_a_load_checkpoint_is_trained_on(mode, tmp_path):
    """A sync collector makes its next rollout only once the learner trained on this one, and waits for a
    version newer than its last: a rollout that a load_checkpoint (which bumps the version) reached
    mid-way, dropped by the lag cap, left both sides waiting until data_timeout_s. The cap is async
    mode's."""
    cfg = _tiny(
        mode=mode, max_policy_lag=0, steps_per_rollout=2048, minibatch_size=2048,
        runner=RunnerConfig(shutdown_timeout_s=10.0, data_timeout_s=30.0),
    )  # fmt: skip
    with APPORunner(cfg) as runner:
        runner.learn(1, log_dir=None)
        path = runner.save_checkpoint(str(tmp_path / "model.pt"))
        if mode == "sync":  # the collector is making its next rollout, with version 1
            _wait_for_a_slot(runner, WRITING, "the collector began no next rollout")
        runner.load_checkpoint(path)
        assert runner.policy_version == 2
        summary = runner.learn(1, log_dir=None)
    assert summary["status"] == "completed" and summary["dropped_stale"] == 0


@pytest.mark.parametrize("weight_refresh", ["step", "rollout"])
def test_sync_mode_drops_a_rollout_of_replaced_weights_after_a_load_checkpoint_and_stays_at_lag_0(
    weight_refresh, tmp_path
):
    """The collector had committed its next rollout (version 1) and waited for version 2; the load
    published the checkpoint's weights as version 2, so the collector made a rollout with them while the
    old one was still queued. Trained on, the old one kept the collector a rollout ahead: every later
    update trained at lag 1."""
    cfg = _tiny(mode="sync", weight_refresh=weight_refresh, runner=RunnerConfig(shutdown_timeout_s=10.0))
    with APPORunner(cfg) as runner:
        runner.learn(1, log_dir=None)
        path = runner.save_checkpoint(str(tmp_path / "model.pt"))
        _wait_for_a_slot(runner, READY, "the collector committed no next rollout")  # it waits for version 2
        runner.load_checkpoint(path)
        assert runner.policy_version == 2
        summary = runner.learn(3, log_dir=None)
    assert summary["status"] == "completed" and summary["dropped_stale"] == 1
    assert [row["rl/policy_lag_max"] for row in runner.history[1:]] == [0.0, 0.0, 0.0]


def test_async_drop_oldest_keeps_the_collector_running():
    with APPORunner(_tiny(overflow="drop_oldest", num_slots=2, max_policy_lag=None, num_epochs=20)) as runner:
        summary = runner.learn(8, log_dir=None)
        assert summary["status"] == "completed"
        # nobody takes rollouts now: a collector that keeps running overflows the ring (the slow learner,
        # 20 epochs, has usually made it overflow already)
        deadline = time.monotonic() + 60
        while runner.ring.stats().dropped_overflow == 0 and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert runner.ring.stats().dropped_overflow > 0
    assert runner.env_frames >= summary["trained_frames"]


def test_checkpoint_and_resume_restore_every_part(tmp_path):
    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(3, save_interval=3, log_dir=str(tmp_path))
        path = runner.last_run_summary["last_checkpoint"]
        state = runner.learner.state_dict()
    assert os.path.basename(path) == "model_3.pt"
    with APPORunner(_tiny(mode="serial"), resume=path) as resumed:
        assert resumed.policy_version == 3 and resumed.iterations_done == 3
        assert resumed.learner.updates == 3
        for key in ("model", "target"):
            for name, tensor in state[key].items():
                assert torch.equal(resumed.learner.state_dict()[key][name], tensor), (key, name)
        assert torch.equal(resumed.learner.normalizer.mean, state["normalizer"]["mean"])
        assert resumed.learner.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()
        # the minibatch order continues where it stopped; the collector's envs and noise do not restart
        assert torch.equal(resumed.learner._shuffle.get_state(), state["shuffle"])
        with (
            APPORunner(_tiny(mode="serial")) as fresh,
            APPORunner(_tiny(mode="serial"), resume=path) as again,
        ):
            assert fresh._spec().seed == resumed.config.seed != resumed._spec().seed == again._spec().seed
        before = resumed.env_frames
        summary = resumed.learn(1, log_dir=None)
        assert resumed.policy_version == 4
        assert before == 3 * resumed.config.frames_per_rollout  # frames of the first run count too
        assert resumed.env_frames == before + resumed.config.frames_per_rollout
        # ... but rates count this run's frames over this run's time
        row, frames = resumed.history[-1], resumed.config.frames_per_rollout
        rate, wall = summary["env_frames_per_s"], summary["wall_time_s"]
        # the summary rounds the time to 1 ms and the rate to 0.1 frame/s: for a 13-ms iteration a
        # relative bound of 5 % was within 1.2 points of failing on rounding alone
        assert abs(rate * wall - frames) <= rate * 0.0005 + wall * 0.05 + 1e-9
        assert row["rl/env_frames_per_s"] * row["rl/wall_s"] == pytest.approx(frames)


def test_ctrl_c_during_learn_saves_the_model_and_records_an_interruption(tmp_path, ctrl_c_raises):
    """A real SIGINT after the second update: the summary says interrupted and names a checkpoint that
    resumes (``simstream rl`` lost every update since its last periodic save before)."""
    import signal

    def interrupt_after_two(row) -> None:
        if row["rl/iteration"] == 2:
            signal.raise_signal(signal.SIGINT)

    with APPORunner(_tiny(mode="serial")) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.learn(10, save_interval=0, log_dir=str(tmp_path), callback=interrupt_after_two)
        summary = runner.last_run_summary
    assert summary["status"] == "interrupted" and summary["iterations"] == 2
    assert summary["last_checkpoint"] == os.path.join(str(tmp_path), "model_2.pt")
    assert sorted(name for name in os.listdir(tmp_path) if name.endswith((".pt", ".partial"))) == [
        "model_2.pt"
    ]
    with APPORunner(_tiny(mode="serial"), resume=summary["last_checkpoint"]) as resumed:
        assert resumed.iterations_done == 2 and resumed.policy_version == 2


def _interrupt_update(runner, at_iteration: int, error: type[BaseException] | None = None) -> None:
    """Make the update after ``at_iteration`` updates raise a real SIGINT inside it (or ``error``)."""
    import signal

    update = runner.learner.update

    def interrupted(batch):
        if runner.iterations_done == at_iteration:
            if error is not None:
                raise error("injected failure inside an update")
            signal.raise_signal(signal.SIGINT)
        return update(batch)

    runner.learner.update = interrupted


def test_ctrl_c_inside_an_update_takes_effect_after_it_and_saves_the_updated_model(tmp_path, ctrl_c_raises):
    """Landing inside an update, a Ctrl-C once saved no checkpoint at all (an update is most of the time
    of a small task): it now waits for the update to be counted, and the model after it is saved."""
    with APPORunner(_tiny(mode="serial")) as runner:
        _interrupt_update(runner, at_iteration=1)
        with pytest.raises(KeyboardInterrupt):
            runner.learn(10, save_interval=0, log_dir=str(tmp_path))
        summary = runner.last_run_summary
        assert runner.weights.version == runner.policy_version == 2
        # the interrupted update is counted in full: a history row and its frames (they were missing)
        assert len(runner.history) == 2 and runner.history[-1]["rl/iteration"] == 2.0
        assert runner.trained_frames == 2 * runner.config.frames_per_rollout
    assert summary["status"] == "interrupted" and summary["iterations"] == 2
    assert summary["last_checkpoint"] == os.path.join(str(tmp_path), "model_2.pt")
    assert sorted(name for name in os.listdir(tmp_path) if name.endswith((".pt", ".partial"))) == [
        "model_2.pt"
    ]


@pytest.mark.parametrize("error", [None, RuntimeError], ids=["ctrl-c", "exception"])
def test_a_sync_runner_trains_on_after_an_update_was_interrupted_or_failed(error, request):
    """The sync collector waits for a newer policy before each rollout: an update cut short published
    none, and every later learn() timed out waiting for a rollout."""
    if error is None:
        request.getfixturevalue("ctrl_c_raises")
    cfg = _tiny(mode="sync", runner=RunnerConfig(shutdown_timeout_s=10.0, data_timeout_s=30.0))
    with APPORunner(cfg) as runner:
        _interrupt_update(runner, at_iteration=1, error=error)
        with pytest.raises(error or KeyboardInterrupt, match=None if error is None else "injected failure"):
            runner.learn(10, log_dir=None)
        del runner.learner.update  # the class's own again
        summary = runner.learn(2, log_dir=None)
    assert summary["status"] == "completed"
    assert summary["iterations"] == (4 if error is None else 3)


def test_a_serial_rollout_cut_short_gives_its_ring_slot_back(ctrl_c_raises):
    """Serial mode collects in the learner's own process: a Ctrl-C inside a rollout kept its slot
    (WRITING) for good, and after ``num_slots`` of them learn() waited forever."""
    import signal

    from simstream.rl.ring import FREE

    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(1, log_dir=None)
        collector = runner._serial
        step = collector._step
        calls = {"count": 0}

        def interrupted_step(view, t, episodes):
            calls["count"] += 1
            if calls["count"] == 5:
                signal.raise_signal(signal.SIGINT)
            return step(view, t, episodes)

        collector._step = interrupted_step
        for _ in range(runner.config.num_slots + 1):
            calls["count"] = 0
            with pytest.raises(KeyboardInterrupt):
                runner.learn(1, log_dir=None)
            assert runner.ring.states() == [FREE] * runner.config.num_slots
        collector._step = step
        summary = runner.learn(2, log_dir=None)
    assert summary["status"] == "completed" and summary["iterations"] == 3


def _ctrl_c_after_the_second_gather(monkeypatch) -> None:
    """A Ctrl-C lands just after the second rollout was copied out of the ring, before its update."""
    import signal

    from simstream.rl.ring import RolloutRing

    gather, calls = RolloutRing.gather, {"count": 0}

    def interrupted_gather(ring, taken):
        out = gather(ring, taken)
        calls["count"] += 1
        if calls["count"] == 2:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(RolloutRing, "gather", interrupted_gather)


def test_a_sync_rollout_taken_when_a_ctrl_c_lands_is_trained_on_by_the_next_learn(monkeypatch, ctrl_c_raises):
    """A Ctrl-C just after a rollout was copied out of the ring, before its update, lost it: the sync
    collector then waited for a newer policy and the learner for a rollout, and every later learn()
    timed out. The rollout is now kept and trained on first by the next learn()."""
    _ctrl_c_after_the_second_gather(monkeypatch)
    cfg = _tiny(mode="sync", runner=RunnerConfig(shutdown_timeout_s=10.0, data_timeout_s=30.0))
    with APPORunner(cfg) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.learn(10, log_dir=None)
        assert runner.iterations_done == 1 and runner._untrained is not None
        kept = runner._untrained[1]["obs"].clone()
        update = runner.learner.update
        trained = []
        monkeypatch.setattr(runner.learner, "update", lambda batch: (trained.append(batch), update(batch))[1])
        summary = runner.learn(2, log_dir=None)
    assert summary["status"] == "completed" and summary["iterations"] == 3
    assert torch.equal(trained[0]["obs"], kept)  # the rollout taken before the Ctrl-C, first
    assert runner.ring.stats().consumed == 3


def test_a_load_checkpoint_drops_the_batch_a_ctrl_c_left_untrained(monkeypatch, ctrl_c_raises, tmp_path):
    """The batch a Ctrl-C left taken was made by the policy the load replaces: trained after the load, it
    pushed out (as stale) the collector's rollout made with the loaded weights, at policy lag 1."""
    _ctrl_c_after_the_second_gather(monkeypatch)
    cfg = _tiny(mode="sync", runner=RunnerConfig(shutdown_timeout_s=10.0, data_timeout_s=30.0))
    with APPORunner(cfg) as runner:
        with pytest.raises(KeyboardInterrupt):
            runner.learn(10, log_dir=None)
        assert runner._untrained is not None
        runner.load_checkpoint(runner.save_checkpoint(str(tmp_path / "model.pt")))
        assert runner._untrained is None
        summary = runner.learn(2, log_dir=None)
    assert summary["status"] == "completed" and summary["dropped_stale"] == 0
    assert [row["rl/policy_lag_max"] for row in runner.history[1:]] == [0.0, 0.0]


def test_runs_with_neighbouring_seeds_start_no_environment_alike():
    """Gymnasium seeds environment i with seed + i: runs with seeds 0 and 1 shared 15 of 16 environments'
    starts, which made a multi-seed comparison far less independent than it claimed."""

    def starts(seed: int) -> torch.Tensor:
        with APPORunner(_tiny(mode="serial", num_envs=16, seed=seed)) as runner:
            runner._ensure_started(None)
            return runner._serial.obs.clone()

    first = starts(0)
    assert len({tuple(row.tolist()) for row in torch.cat([first, starts(1)])}) == 32  # all distinct
    assert torch.equal(starts(0), first)  # and each seed's are reproducible


def _learn_once_interrupted(runner, monkeypatch, owner, name: str, interrupting) -> None:
    """One ``learn()`` with ``owner.name`` replaced by ``interrupting(original)`` (which raises
    ``KeyboardInterrupt``), then the original put back."""
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, interrupting(original))
    with pytest.raises(KeyboardInterrupt):
        runner.learn(1, log_dir=None)
    monkeypatch.setattr(owner, name, original)


def test_a_serial_rollout_committed_when_a_ctrl_c_lands_is_trained_on_next_not_kept_behind(monkeypatch):
    """A Ctrl-C after the serial collector committed its rollout, before the learner took it, left it
    READY: every later iteration collected a new rollout and trained on the one before (policy lag 1 for
    the rest of the run, serial no longer equal to sync)."""
    from simstream.rl.ring import FREE, RolloutRing

    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(2, log_dir=None)

        def commit_then_ctrl_c(commit):
            def replacement(ring, slot, version):
                commit(ring, slot, version)
                raise KeyboardInterrupt

            return replacement

        _learn_once_interrupted(runner, monkeypatch, RolloutRing, "commit", commit_then_ctrl_c)
        runner.learn(4, log_dir=None)
        assert runner.ring.states() == [FREE] * runner.config.num_slots
    lags = [row["rl/policy_lag"] for row in runner.history]
    assert lags == [0, 0, 0, 0, 0, 0], lags  # the rollout left behind was made with the current policy


def test_a_ctrl_c_inside_the_serial_collector_s_weight_copy_leaves_no_mixed_policy(monkeypatch):
    """The collector took the new version before copying the weights: cut short, its model was half old,
    half new, stamped new, and not read again until the next publish (V-trace then clipped half the
    importance ratios of a rollout that must have none)."""
    import simstream.rl.collector as collector_module

    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(2, log_dir=None)

        def copy_cut_short(_unpack):
            def replacement(vector, model, normalizer):
                first = next(model.parameters())
                with torch.no_grad():
                    first.copy_(vector[: first.numel()].view_as(first))
                raise KeyboardInterrupt

            return replacement

        _learn_once_interrupted(runner, monkeypatch, collector_module, "unpack_policy", copy_cut_short)
        runner.learn(2, log_dir=None)
    assert [row["vtrace/rho_clip_fraction"] for row in runner.history] == [0.0] * 4


def test_a_ctrl_c_inside_a_serial_environment_step_lets_the_step_finish(ctrl_c_raises):
    """Serial mode steps the environments in the learner's thread: a Ctrl-C inside ``envs.step`` left the
    environments a step ahead of the observation the collector kept (and of its episode counters), so
    the next rollout began from a stale observation."""
    import signal

    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(1, log_dir=None)
        collector = runner._serial
        step, returned = collector.envs.step, []

        def interrupted_step(actions):
            result = step(actions)
            returned.append(result[0])
            signal.raise_signal(signal.SIGINT)
            return result

        collector.envs.step = interrupted_step
        with pytest.raises(KeyboardInterrupt):
            runner.learn(1, log_dir=None)
        collector.envs.step = step
        assert len(returned) == 1
        assert torch.equal(collector.obs, torch.as_tensor(returned[0], dtype=torch.float32))
        summary = runner.learn(1, log_dir=None)
    assert summary["status"] == "completed"


def test_load_checkpoint_on_a_closed_runner_is_refused_before_anything_changes(tmp_path):
    runner = APPORunner(_tiny(mode="serial"))
    with runner:
        runner.learn(1, log_dir=str(tmp_path))
    path = runner.last_run_summary["last_checkpoint"]
    version = runner.policy_version
    with pytest.raises(RuntimeError, match="APPORunner is closed; create a new runner to train again"):
        runner.load_checkpoint(path)
    assert runner.policy_version == version


def test_resume_rejects_a_checkpoint_of_another_task(tmp_path):
    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(1, log_dir=str(tmp_path))
        path = runner.last_run_summary["last_checkpoint"]
    with pytest.raises(ValueError, match="obs_dim, act_dim"):
        APPORunner(APPOConfig(env_id="InvertedPendulum-v5", mode="serial"), resume=path)


def test_resume_rejects_a_checkpoint_of_another_task_with_the_same_dimensions(tmp_path):
    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(1, log_dir=str(tmp_path))
        path = runner.last_run_summary["last_checkpoint"]
    other = env_id("slow_close")  # the same observation and action sizes
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"checkpoint {path} was trained on env_id={env_id('none')!r}; this runner has env_id={other!r}"
        ),
    ):
        APPORunner(_tiny(mode="serial", env_id=other), resume=path)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [({"normalize_obs": False}, "normalize_obs=True; this runner has normalize_obs=False"),
     ({"hidden_sizes": (8,)}, r"hidden_sizes=\(16,\); this runner has hidden_sizes=\(8,\)")],
)  # fmt: skip
def test_resume_rejects_a_checkpoint_the_collector_would_build_differently(tmp_path, override, fragment):
    """The learner restores the checkpoint's normaliser and network; the collector builds its own from the
    config: a difference would make them act and train on different observations, silently."""
    with APPORunner(_tiny(mode="serial")) as runner:
        runner.learn(1, log_dir=str(tmp_path))
        path = runner.last_run_summary["last_checkpoint"]
    with pytest.raises(
        ValueError, match=rf"checkpoint {path} was trained with {fragment} .*pass the checkpoint's"
    ):
        APPORunner(_tiny(mode="serial", **override), resume=path)


def test_resume_rejects_a_file_that_is_not_a_checkpoint(tmp_path):
    other, garbage = tmp_path / "other.pt", tmp_path / "garbage.pt"
    torch.save({"hello": 1}, other)
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=rf"{other} is not an APPORunner checkpoint: it has no \['learner'"):
        APPORunner(_tiny(mode="serial"), resume=str(other))
    with pytest.raises(ValueError, match=rf"^{garbage} is not a checkpoint torch.load can read \(\w+\)$"):
        APPORunner(_tiny(mode="serial"), resume=str(garbage))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loading_a_checkpoint_into_a_running_runner_keeps_versions_increasing(tmp_path, mode):
    """A sync collector waits for a version newer than its last: a restored older number would stall it."""
    cfg = _tiny(mode=mode, runner=RunnerConfig(shutdown_timeout_s=10.0, data_timeout_s=30.0))
    with APPORunner(cfg) as runner:
        runner.learn(2, log_dir=None)
        path = runner.save_checkpoint(str(tmp_path / "two.pt"))
        runner.learn(2, log_dir=None)
        before = runner.policy_version
        runner.load_checkpoint(path)
        assert runner.policy_version == before + 1  # the restored weights, as the next version
        runner.learn(2, log_dir=None)
        assert runner.policy_version == before + 3
        assert all(row["rl/policy_lag"] >= 0 for row in runner.history)


_UNGUARDED_SCRIPT = """
from simstream.rl import APPOConfig, APPORunner, CollectorDiedError
from tests.rl.fault_env import env_id

runner = APPORunner(APPOConfig(env_id=env_id("none"), num_envs=1, steps_per_rollout=8, minibatch_size=8))
try:
    runner.learn(1, log_dir=None)
except CollectorDiedError as error:
    print("REPORT:", error.report, flush=True)
finally:
    runner.close()
"""


_SCRIPT_S = 180.0
"""Bound of a script run in a subprocess (its collector is spawned and imports the script again)."""


def _run_script(path, text: str):
    """Run ``text`` as a script of its own (from the repository root, which it imports) and wait for it."""
    import subprocess
    import sys
    from pathlib import Path

    path.write_text(text)
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, cwd=root, timeout=_SCRIPT_S,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_a_script_without_a_main_guard_is_told_why_its_collector_died(tmp_path):
    done = _run_script(tmp_path / "unguarded.py", _UNGUARDED_SCRIPT)
    report = done.stdout.split("REPORT:", 1)[-1]
    assert "REPORT:" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Collector process exited with code 1" in report
    assert "It exited before any of its own code ran" in report and '__name__ == "__main__"' in report


def test_learn_validates_its_arguments():
    runner = APPORunner(_tiny(mode="serial"))
    with pytest.raises(ValueError, match="max_iterations must be an int >= 1, got 0"):
        runner.learn(0)
    for kwargs, message in (
        (
            {"max_env_frames": "100"},
            "APPORunner.learn.max_env_frames must be None or a whole number >= 1, got '100'",
        ),
        (
            {"max_env_frames": -1},
            "APPORunner.learn.max_env_frames must be None or a whole number >= 1, got -1",
        ),
        (
            {"max_env_frames": 2.5},
            "APPORunner.learn.max_env_frames must be None or a whole number >= 1, got 2.5",
        ),
        ({"target_return": "5"}, "APPORunner.learn.target_return must be None or a finite number, got '5'"),
        (
            {"max_wall_s": math.nan},
            "APPORunner.learn.max_wall_s must be None or a finite number > 0, got nan",
        ),
        ({"max_wall_s": "10"}, "APPORunner.learn.max_wall_s must be None or a finite number > 0, got '10'"),
    ):
        with pytest.raises(ValueError) as caught:
            runner.learn(1, **kwargs)
        assert str(caught.value) == message
    assert runner.iterations_done == 0  # refused before any update
    assert runner.learn(1, max_env_frames=2e5, log_dir=None)["iterations"] == 1  # a float or NumPy count
    assert runner.learn(1, max_env_frames=np.int64(200_000), log_dir=None)["iterations"] == 2  # in all
    runner.close()


def test_cli_writes_the_report(tmp_path, capsys):
    from simstream.cli.main import main

    code = main([
        "rl", "--env", env_id("none"), "--num-envs", "2", "--steps-per-rollout", "16",
        "--minibatch-size", "16", "--iterations", "3",
        "--runs-dir", str(tmp_path), "--name", "tiny", "--no-progress",
    ])  # fmt: skip
    assert code == 0
    run_dir = tmp_path / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == 3
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    assert (run_dir / "model_3.pt").exists()
    assert not (run_dir / "collector_crash.log").exists()  # empty crash logs are removed


def test_cli_exits_non_zero_with_the_report_when_the_collector_dies(tmp_path, capsys):
    from simstream.cli.rl import EXIT_COLLECTOR_DIED, main

    code = main([
        "--env", env_id("raise"), "--num-envs", "2", "--steps-per-rollout", "16", "--minibatch-size", "16",
        "--runs-dir", str(tmp_path), "--name", "dies", "--no-progress",
    ])  # fmt: skip
    assert code == EXIT_COLLECTOR_DIED
    err = capsys.readouterr().err
    assert "the collector process died" in err
    assert "ValueError: injected failure in the middle of a rollout" in err
    summary = json.loads((tmp_path / "dies" / "summary.json").read_text())
    assert summary["status"] == "collector_died"
    assert "injected failure" in summary["failure"]
    assert "injected failure" in (tmp_path / "dies" / "collector_crash.log").read_text()


def _sigterm_the_cli_once(
    options: list[str], tmp_path, ready, *, environment: dict | None = None, sigint_ignored: bool = False
) -> tuple[int, str]:
    """Run ``simstream rl OPTIONS``, send it SIGTERM once ``ready()`` holds (bounded), and return its exit
    code and output."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable,
        "-m",
        "simstream",
        "rl",
        *options,
        "--runs-dir",
        str(tmp_path),
        "--no-progress",
    ]
    with open(tmp_path / "out.txt", "w") as out:
        cli = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=root,
            env={**os.environ, "PYTHONPATH": str(root), **(environment or {})},
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + _SCRIPT_S
            while not ready():  # bounded, and checks the CLI
                assert cli.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()
                threading.Event().wait(0.05)
            cli.send_signal(signal.SIGTERM)
            code = cli.wait(timeout=60)
        finally:
            cli.kill()
            cli.wait(30)
    return code, (tmp_path / "out.txt").read_text()


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_cli_handles_sigterm_as_ctrl_c_saving_the_model_and_the_report(tmp_path):
    """A scheduler's or ``kill``'s SIGTERM ended the run with no checkpoint and no summary.json."""
    from simstream.cli.rl import EXIT_TERMINATED

    run_dir = tmp_path / "term"
    options = [
        "--env", env_id("none"), "--num-envs", "2", "--steps-per-rollout", "16", "--minibatch-size", "16",
        "--iterations", "100000", "--save-interval", "1", "--name", "term",
    ]  # fmt: skip
    code, text = _sigterm_the_cli_once(options, tmp_path, (run_dir / "model_2.pt").exists)  # two updates
    assert code == EXIT_TERMINATED == 143, text[-3000:]
    assert "simstream rl: terminated (SIGTERM)" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["iterations"] >= 2
    assert summary["last_checkpoint"] == str(run_dir / f"model_{summary['iterations']}.pt")
    assert os.path.exists(summary["last_checkpoint"])
    assert not (run_dir / "collector_crash.log").exists()


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_cli_sigterm_while_the_collector_closes_lets_close_finish_and_exits_143(tmp_path, sigint_ignored):
    """A SIGTERM while ``close()`` waited for the collector cut ``close()`` short (the collector was left to
    the exit finalizer's terminate()) and exited 130, "interrupted". With SIGINT ignored (a background job
    of a non-interactive shell) the held SIGTERM, re-raised as a SIGINT, vanished: exit 0."""
    from simstream.cli.rl import EXIT_TERMINATED

    closing = tmp_path / "closing"  # written by the collector's environment as its close() begins
    options = [
        "--env", env_id("slow_close"), "--num-envs", "1", "--steps-per-rollout", "16", "--minibatch-size",
        "16", "--iterations", "2", "--name", "run",
    ]  # fmt: skip
    code, text = _sigterm_the_cli_once(
        options, tmp_path, closing.exists, environment={"SIMSTREAM_RL_FAULT_STAMP": str(closing)},
        sigint_ignored=sigint_ignored,
    )  # fmt: skip
    assert code == EXIT_TERMINATED, text[-3000:]
    assert "simstream rl: terminated (SIGTERM)" in text
    assert "did not exit in time" not in text, text[-3000:]  # the collector finished its close()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["close_errors"] == []
    assert "exitcode=0" in summary["close_report"], summary["close_report"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--iterations", "0"], "--iterations must be an int >= 1, got 0"),
        (["--save-interval", "-1"], "--save-interval must be an int >= 0, got -1"),
        (["--sync", "--serial"], "--sync, --serial and --mode choose different modes ['serial', 'sync']"),
        (["--mode", "async", "--serial"], "choose different modes ['async', 'serial']"),
        (["--max-env-frames", "-5"], "--max-env-frames must be None or an int >= 1, got -5"),
        (["--target-return", "nan"], "--target-return must be None or a finite number"),
        (["--env", "NoSuch-v0"], "--env 'NoSuch-v0' is not a gymnasium environment here"),
        (
            ["--env", "simstream_no_such_module:X-v0"],
            "--env 'simstream_no_such_module:X-v0': there is no module 'simstream_no_such_module' to import",
        ),
        (["--resume", "missing.pt"], "--resume 'missing.pt' is not a checkpoint file"),
        (["--num-envs", "0"], "num_envs must be"),
        (["--num-envs", "100000"], "APPOConfig.num_envs must be an int in [1, 4096], got 100000"),
        (["--learner-num-threads", "100000"], "APPOConfig.learner_num_threads must be an int in [0, "),
        (["--gamma", "1.5"], "APPOConfig.gamma must be a number in [0, 1], got 1.5 (option --gamma)"),
        (["--runner.hang-timeout-s", "0"], "RunnerConfig.hang_timeout_s must be a number in (0, 1e6]"),
        (["--name", ".."], f"--name must be {FOLDER_NAME_RULE}, got '..'"),
        (["--name", ""], f"--name must be {FOLDER_NAME_RULE}, got ''"),
        (["--name", "a/b"], f"--name must be {FOLDER_NAME_RULE}, got 'a/b'"),
        (["--name", "x" * 256], f"--name must be {FOLDER_NAME_RULE}, got 'xxx"),
        (  # it failed in the first learn(), with the allocator's message, after the run folder was made
            ["--steps-per-rollout", "100000000", "--minibatch-size", "64"],
            "a rollout ring of num_slots=4 rollouts of num_envs=16 x steps_per_rollout=100000000 frames",
        ),
    ],
)
def test_cli_rejects_a_bad_option_with_exit_code_2_and_writes_nothing(options, message, tmp_path, capsys):
    from simstream.cli.rl import main

    runs = tmp_path / "runs"
    code = main(["--env", env_id("none"), "--runs-dir", str(runs), "--no-progress", *options])
    captured = capsys.readouterr()
    assert code == 2
    assert message in " ".join((captured.out + captured.err).split()), captured
    assert "Traceback" not in captured.err
    assert not runs.exists()


def test_cli_refuses_a_run_name_that_holds_a_run_unless_it_resumes_from_it(tmp_path, capsys):
    """A second run under one --name mixed its TensorBoard events and checkpoints with the first's."""
    from simstream.cli.rl import main

    run_dir = tmp_path / "runs" / "ip"
    run_dir.mkdir(parents=True)
    (run_dir / "model_2.pt").write_bytes(b"a checkpoint of the first run")
    common = ["--env", env_id("none"), "--runs-dir", str(tmp_path / "runs"), "--name", "ip", "--no-progress"]
    assert main(common) == 2
    assert f"--name: '{run_dir}' already holds a run" in " ".join(capsys.readouterr().err.split())
    assert sorted(p.name for p in run_dir.iterdir()) == ["model_2.pt"]
    # resuming from a checkpoint inside it continues that run: past the name check (this file is no model)
    assert main([*common, "--resume", str(run_dir / "model_2.pt")]) != 0
    assert "already holds a run" not in capsys.readouterr().err


def test_default_run_names_of_runs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    """Two runs without --name in one second got one name; the second was refused for a --name never given
    (rl), or both wrote into one folder (demo). The folder is claimed with the name, so neither can happen."""
    from simstream import _runs

    monkeypatch.setattr(_runs.time, "strftime", lambda fmt: "20261204-120000")
    runs = tmp_path / "runs"  # created with the first run's folder
    assert _runs.claim_run_folder(runs, "Hopper-v5-async") == "Hopper-v5-async-20261204-120000"
    assert _runs.claim_run_folder(runs, "Hopper-v5-async") == "Hopper-v5-async-20261204-120000-2"
    assert sorted(p.name for p in runs.iterdir()) == [
        "Hopper-v5-async-20261204-120000",
        "Hopper-v5-async-20261204-120000-2",
    ]


def test_cli_reports_an_env_package_whose_own_import_fails_as_that_failure(tmp_path, capsys, monkeypatch):
    """The env's package exists but imports a missing dependency: exit 1 naming that dependency, not
    "there is no module" (exit 2, a bad option)."""
    from simstream.cli.rl import main

    package = tmp_path / "simstream_broken_envs"
    package.mkdir()
    (package / "__init__.py").write_text("import simstream_missing_dependency\n")
    (package / "envs.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["--env", "simstream_broken_envs.envs:Env-v0", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 1 and "simstream_missing_dependency" in err and "there is no module" not in err, err


def test_cli_names_a_runs_dir_it_cannot_create(tmp_path, capsys):
    from simstream.cli.rl import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["--env", env_id("none"), "--runs-dir", str(blocker), "--name", "x", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "--runs-dir/--name: cannot create" in err and "Traceback" not in err


def test_a_reused_run_directory_never_shows_an_earlier_crash(tmp_path, capsys):
    from simstream.cli.rl import EXIT_COLLECTOR_DIED, main

    common = ["--num-envs", "2", "--steps-per-rollout", "16", "--minibatch-size", "16",
              "--runs-dir", str(tmp_path), "--name", "again", "--no-progress"]  # fmt: skip
    assert main(["--env", env_id("raise"), *common]) == EXIT_COLLECTOR_DIED
    assert "injected failure" in (tmp_path / "again" / "collector_crash.log").read_text()
    capsys.readouterr()
    assert main(["--env", env_id("sigkill"), *common]) == 2  # the command refuses a folder holding a run
    capsys.readouterr()
    # the library takes any log_dir
    cfg = APPOConfig(env_id=env_id("sigkill"), num_envs=2, steps_per_rollout=16, minibatch_size=16)
    with pytest.raises(CollectorDiedError) as died, APPORunner(cfg) as runner:
        runner.learn(5, log_dir=str(tmp_path / "again"))
    err = f"{died.value}\n{died.value.report}"
    assert "killed by signal 9 (SIGKILL)" in err
    assert "injected failure" not in err  # the first run's traceback is not this run's diagnosis
    assert "Crash log:" not in err  # SIGKILL writes nothing, and the empty log is removed
    assert not (tmp_path / "again" / "collector_crash.log").exists()


@pytest.mark.slow
def test_async_ppo_learns_inverted_pendulum():
    """Mean return of 20 consecutive training episodes >= 900 within 150k env frames (typically ~40k)."""
    cfg = APPOConfig(env_id="InvertedPendulum-v5", num_envs=16, steps_per_rollout=32, seed=0)
    with APPORunner(cfg) as runner:
        summary = runner.learn(1_000, log_dir=None, max_env_frames=150_000, target_return=900.0)
    assert summary["mode"] == "async"
    assert summary["final_return"] >= 900.0, summary
    assert summary["env_frames"] <= 150_000 + cfg.num_slots * cfg.frames_per_rollout
    assert summary["mean_policy_lag"] > 0  # it really ran off-policy


_ORPHAN_SCRIPT = """
import os, signal, sys
from simstream.rl import APPOConfig, APPORunner
from tests.rl.fault_env import env_id

if __name__ == "__main__":
    cfg = APPOConfig(env_id=env_id("none"), num_envs=2, steps_per_rollout=16, minibatch_size=16)
    runner = APPORunner(cfg)
    runner.learn(2, log_dir=None if sys.argv[1] == "-" else sys.argv[1], save_interval=0)
    print(runner.collector_pid, runner._crash_log.directory, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the collector is orphaned
"""


_CRASHING_SCRIPT = """
from simstream.rl import APPOConfig, APPORunner
from tests.rl.fault_env import env_id

if __name__ == "__main__":
    cfg = APPOConfig(env_id=env_id("none"), num_envs=2, steps_per_rollout=16, minibatch_size=16)
    runner = APPORunner(cfg)
    runner.learn(1, log_dir=None)
    print(runner._crash_log.directory, flush=True)
    raise SystemExit("the script crashes without close()")
"""


@pytest.mark.timeout(_SCRIPT_S + 60)
def test_a_script_that_crashes_without_close_leaves_no_crash_log_directory(tmp_path):
    done = _run_script(tmp_path / "crashing.py", _CRASHING_SCRIPT)
    assert done.returncode == 1 and "the script crashes without close()" in done.stderr
    directory = done.stdout.split()[0]
    assert "simstream-rl-" in directory and not os.path.exists(directory)


@pytest.mark.parametrize("run_dir", [False, True], ids=["temporary-crash-log", "run-directory"])
def test_collector_exits_when_the_learner_is_killed(tmp_path, run_dir):
    """...and cleans up the crash log as the learner's close() would: the temporary directory, or the
    empty log in a run directory (whose checkpoint stays)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "learner.py"
    script.write_text(_ORPHAN_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    log_dir = tmp_path / "run" if run_dir else None
    # Output goes to a file, not a pipe: an orphan holding the pipe open would block reading it.
    with open(tmp_path / "out.txt", "w") as out:
        learner = subprocess.Popen(
            [sys.executable, str(script), str(log_dir or "-")], stdout=out, stderr=subprocess.STDOUT,
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )  # fmt: skip
        learner.wait(timeout=90)
    text = (tmp_path / "out.txt").read_text()
    pid = int(text.split()[0]) if text.split() and text.split()[0].isdigit() else None
    assert pid is not None, text[-2000:]
    try:
        wait_for_exit([pid], 10.0, "the orphaned collector, 10 s after its learner was killed")
    except AssertionError:
        os.kill(pid, 9)
        raise
    crash_dir = text.split()[1]
    if log_dir is None:
        assert "simstream-rl-" in crash_dir
        assert not os.path.exists(crash_dir), "the orphan left the learner's temporary crash-log directory"
    else:
        assert crash_dir == str(log_dir)
        left = os.listdir(log_dir)
        assert "model_2.pt" in left and "collector_crash.log" not in left, left
