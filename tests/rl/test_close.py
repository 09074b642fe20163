"""``close()`` reports every resource it could not release, and the run summary and the CLI carry it.

The failures are real: an environment whose ``close()`` raises (the fault env, in serial mode, where the
learner's process releases the collector) and a queue whose feeder thread is blocked on a full pipe.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading

import pytest

from simstream.rl import APPOConfig, APPORunner, RunnerConfig
from tests.rl.collectors import ToyRunner, take_one
from tests.rl.fault_env import env_id

pytestmark = pytest.mark.timeout(120)

CTX = mp.get_context("spawn")
ENV_CLOSE_ERROR = "RolloutCollector.close() failed: OSError: FaultEnv.close could not release the simulator"


def _serial(fault: str) -> APPOConfig:
    # one env: gymnasium's vector env stops at the first env whose close() raises
    return APPOConfig(
        env_id=env_id(fault), num_envs=1, steps_per_rollout=16, minibatch_size=16, num_epochs=1,
        hidden_sizes=(16,), stats_window=2, mode="serial",
    )  # fmt: skip


def test_a_registered_queue_is_closed_and_its_feeder_thread_joined():
    runner = ToyRunner()
    queue = runner._register_shared(CTX.Queue())
    before = set(threading.enumerate())
    queue.put("item")  # starts the queue's feeder thread
    (feeder,) = [t for t in threading.enumerate() if t not in before and t.name == "QueueFeederThread"]
    report = runner.close()
    assert report.clean and report.errors == () and report.released == 2
    assert not feeder.is_alive()  # join_thread() returned: everything buffered reached the pipe
    with pytest.raises(ValueError, match="is closed"):
        queue.put("late")


def test_a_queue_nobody_reads_is_reported_instead_of_waited_for_forever():
    runner = ToyRunner(config=RunnerConfig(shutdown_timeout_s=1.0))
    queue = runner._register_shared(CTX.Queue())
    queue.put(b"x" * (1 << 20))  # more than a pipe holds: the feeder blocks until someone reads
    report = runner.close()
    assert not report.clean
    assert report.released == 1 and runner.resource.released == 1  # the other resource still released
    (error,) = report.errors
    assert error.startswith(
        "Queue.join_thread() failed: TimeoutError: its feeder thread did not finish within 1 s"
    )
    assert "those items are lost" in error
    assert runner.close() is report  # idempotent
    reader = CTX.Process(target=take_one, args=(queue,))  # lets the feeder (and the joiner) finish
    reader.start()
    reader.join(60)
    assert reader.exitcode == 0


def test_a_resource_that_fails_to_release_is_in_the_report_and_in_learns_summary(caplog):
    with APPORunner(_serial("close")) as runner:
        summary = runner.learn(2, log_dir=None)
        assert summary["status"] == "completed" and summary["close_errors"] is None  # not closed yet
    report = runner.last_close_report
    assert not report.clean
    assert report.failure is None and not report.forced  # the collector itself was fine
    (error,) = report.errors
    assert error.startswith(ENV_CLOSE_ERROR)
    assert report.released == 2  # the ring and the weight buffer were still released
    assert summary is runner.last_run_summary and summary["close_errors"] == [error]
    assert "releasing RolloutCollector failed" in caplog.text


def test_a_clean_close_leaves_an_empty_error_list_in_the_summary():
    with APPORunner(_serial("none")) as runner:
        summary = runner.learn(1, log_dir=None)
    assert runner.last_close_report.clean and runner.last_close_report.errors == ()
    assert summary["close_errors"] == []


def test_the_cli_exits_non_zero_when_a_resource_cannot_be_released(tmp_path, capsys):
    from simstream.cli.rl import EXIT_CLOSE_FAILED, main

    code = main([
        "--env", env_id("close"), "--serial", "--num-envs", "1", "--steps-per-rollout", "16",
        "--minibatch-size", "16", "--iterations", "2", "--runs-dir", str(tmp_path), "--name", "leaky",
        "--no-progress",
    ])  # fmt: skip
    assert code == EXIT_CLOSE_FAILED
    err = capsys.readouterr().err
    assert "shared resources could not be released" in err and ENV_CLOSE_ERROR in err
    summary = json.loads((tmp_path / "leaky" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["mode"] == "serial"
    assert len(summary["close_errors"]) == 1 and summary["close_errors"][0].startswith(ENV_CLOSE_ERROR)


def test_save_interval_zero_means_no_periodic_checkpoints(tmp_path):
    with APPORunner(_serial("none")) as runner:
        summary = runner.learn(3, save_interval=0, log_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("model_*.pt")) == ["model_3.pt"]  # only the final one
    assert summary["last_checkpoint"].endswith("model_3.pt")


def test_the_cli_mode_flags_choose_the_mode(tmp_path):
    from simstream.cli.rl import main

    common = [
        "--env", env_id("none"), "--num-envs", "1", "--steps-per-rollout", "16", "--minibatch-size", "16",
        "--iterations", "1", "--runs-dir", str(tmp_path), "--no-progress", "--save-interval", "0",
    ]  # fmt: skip
    assert main([*common, "--name", "a", "--mode", "serial"]) == 0
    assert main([*common, "--name", "b", "--sync"]) == 0
    modes = [json.loads((tmp_path / n / "summary.json").read_text())["mode"] for n in ("a", "b")]
    assert modes == ["serial", "sync"]


@pytest.mark.parametrize(
    ("mode", "failing"),
    [("async", "spawn"), ("serial", "collector"), ("sync", "weight buffer"), ("serial", "weight buffer")],
)
def test_a_collector_that_failed_to_start_is_named_by_every_later_learn(monkeypatch, mode, failing):
    """A spawn that fails once (EAGAIN), a serial collector whose environments cannot be built, or shared
    memory for the policy that cannot be set up (/dev/shm full) leaves a runner without a collector: the
    next learn() says so at once instead of waiting data_timeout_s and blaming a live collector that never
    existed (serial mode, and a failure before the collector's start, waited)."""
    from simstream.rl import appo_runner
    from simstream.workers import supervisor

    def failing_start(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    patched = {
        "spawn": (supervisor.WorkerSupervisor, "start"),
        "collector": (appo_runner, "RolloutCollector"),
        "weight buffer": (appo_runner, "WeightBuffer"),
    }[failing]
    monkeypatch.setattr(*patched, failing_start)
    cfg = APPOConfig(
        env_id=env_id("none"), num_envs=2, steps_per_rollout=16, minibatch_size=16, hidden_sizes=(16,),
        mode=mode, runner=RunnerConfig(data_timeout_s=600.0, shutdown_timeout_s=5.0),
    )  # fmt: skip
    with APPORunner(cfg) as runner:
        with pytest.raises(BlockingIOError, match="Resource temporarily unavailable"):
            runner.learn(1, log_dir=None)
        with pytest.raises(
            RuntimeError, match=r"its collector failed to start \(BlockingIOError: .*close\(\)"
        ):
            runner.learn(1, log_dir=None)
        assert runner.collector_pid is None


def test_a_ctrl_c_while_the_collector_starts_stops_it_again(monkeypatch, ctrl_c_raises):
    """The supervisor holds a Ctrl-C back until the collector is started and registered; the runner took
    the KeyboardInterrupt for a start that never happened and dropped the supervisor, leaving the
    collector running unsupervised (close() reported clean, and the interpreter's exit joined it
    forever)."""
    import signal

    from simstream.workers import supervisor as supervisor_module

    started = supervisor_module._read_exit_status_once

    def started_then_interrupted(process, *args):
        started(process, *args)
        signal.raise_signal(signal.SIGINT)  # held by the supervisor until the collector is registered

    monkeypatch.setattr(supervisor_module, "_read_exit_status_once", started_then_interrupted)
    runner = ToyRunner()
    with pytest.raises(KeyboardInterrupt):
        runner.learn(1)
    assert runner._supervisor is None and mp.active_children() == []
    runner.close()
    assert runner.last_close_report.clean
