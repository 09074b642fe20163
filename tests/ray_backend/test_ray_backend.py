"""The engine's contract with producers as Ray actors on a second node (``simstream.ray``).

Every engine here pins its producers to the ``sim`` node, so each window crosses Ray's object transfer
into the trainer's shared buffer. Waits are bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch.utils.data import DataLoader

from simstream import (
    DataBudgetExhaustedError,
    Field,
    OnlineDataEngine,
    OnlineDataEngineCfg,
    OnlineDataEngineState,
    OnlineDataWorkerError,
)
from simstream.data import OnlineDataset
from simstream.ray import RayBackend, RayProducerError
from tests.ray_backend.conftest import SIM_CPUS, sim_available, wait_for
from tests.support.engines import stop_quietly
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(180)

SEGMENTS = ((0, 8, "reach the block", True), (8, 20, "place it", True))


def ray_cfg(spec: ScriptedSpec | None = None, backend: RayBackend | None = None, **overrides):
    values = {
        "source": spec or ScriptedSpec(segments=SEGMENTS),
        "buffer_size": 4,
        "num_workers": 2,
        "refill_policy": "manual",
        "shutdown_timeout": 10.0,
        "initialization_timeout": 120.0,
        "backend": backend or RayBackend(resources={"sim": 1}, restart_delay_s=0.0, max_restarts=1),
    }
    values.update(overrides)
    return OnlineDataEngineCfg(**values)


def sim_node_id(cluster) -> str:
    return cluster[1].node_id


def assert_chunks_are_consecutive_frames_of_one_episode(batch) -> None:
    assert bool(batch["valid"].all())
    tags, steps = batch["obs"][..., 0], batch["obs"][..., 1]
    assert bool((tags == tags[:, :1]).all())
    assert bool((steps[:, 1:] - steps[:, :-1] == 1).all())


def test_contract_sampling_provenance_lifecycle_and_language(cluster):
    cfg = ray_cfg(include_provenance=True, lifecycle_event_capacity=64)
    with OnlineDataEngine(cfg) as engine:
        producers = engine.get_stats()["producers"]
        assert [p["node_id"] for p in producers] == [sim_node_id(cluster)] * 2  # on the sim node, hex
        assert all(p["restarts"] == 0 and p["alive"] and p["episodes"] == 2 for p in producers)
        wait_for(
            lambda: sim_available() == SIM_CPUS - 2, "the view of the producers' resources"
        )  # updated asynchronously
        for mode, size in (("episode", 12), ("segment", 6), ("boundary", 4)):
            batch = engine.sample_batch(16, size, mode)
            assert_chunks_are_consecutive_frames_of_one_episode(batch)
        segment = engine.sample_batch(32, 8, "segment")
        texts = engine.resolve_language(segment)
        assert set(texts["task"][0]) == {"stack the blocks"}  # interned on the trainer's side
        assert {row[0] for row in texts["subtask"]} <= {"reach the block", "place it"}
        contexts = engine.sample_batch_with_context(8, 4, 3)
        assert contexts.batch_size == torch.Size([8, 6])
        assert bool(contexts["loss_mask"][:, 3:].any())
        first = engine.drain_lifecycle_events()
        assert [e["kind"] for e in first] == ["published"] * 4
        generation = engine.request_refill()
        engine.wait_for_generation(generation, timeout=60)
        second = engine.drain_lifecycle_events()
        assert sorted(e["kind"] for e in second) == ["evicted"] * 4 + ["published"] * 4
        ids = [e["episode_id"] for e in first + second if e["kind"] == "published"]
        assert ids == sorted(ids) and len(set(ids)) == 8  # unique and increasing across actors
        batch = engine.sample_batch(64, 4)
        assert set(batch["ods_generation"].unique().tolist()) == {2}
        assert bool((batch["ods_episode_id"] >= 4).all())


def test_quotas_and_the_sample_threshold_policy(cluster):
    cfg = ray_cfg(episode_sample_budget=2, episode_sample_hard_limit=2)
    with OnlineDataEngine(cfg) as engine:
        for _ in range(2):
            engine.sample_batch(4, 5)
        with pytest.raises(DataBudgetExhaustedError):
            engine.sample_batch(4, 5)
        generation = engine.request_refill()
        engine.wait_for_generation(generation, timeout=60)
        snapshot = engine.get_sampling_budget_snapshot()
        assert snapshot["unlocked_remaining_chunks"] == 8
        engine.sample_batch(8, 5)
    spec = ScriptedSpec(num_envs=1, segments=SEGMENTS)  # two windows per producer, both in one call
    backend = RayBackend(resources={"sim": 1}, windows_per_call=2)
    with OnlineDataEngine(
        ray_cfg(spec, backend, refill_policy="sample_threshold", refill_threshold=1)
    ) as engine:
        # every buffer_size chunks ask for a generation; the actors deliver it
        engine.sample_batch(4, 5)
        wait_for(lambda: engine.get_stats()["completed_generation"] >= 2, "a threshold refill")
        assert engine.get_stats()["successful_episodes"] >= 8


def test_fields_numpy_lacks_cross_ray_bit_for_bit(cluster):
    """bfloat16 has no NumPy dtype: the actor returns its bits as int16 and the ingest writes them back."""
    extra = {"half": Field((2,), torch.bfloat16), "count": Field((), torch.int16)}
    with OnlineDataEngine(ray_cfg(ScriptedSpec(segments=SEGMENTS, extra_fields=extra))) as engine:
        batch = engine.sample_batch(16, 12)
    steps = batch["obs"][..., 1]  # the frame index t, which the source writes into every extra field
    assert batch["half"].dtype == torch.bfloat16
    assert torch.equal(batch["half"], steps.to(torch.bfloat16).unsqueeze(-1).expand(-1, -1, 2))
    assert torch.equal(batch["count"], steps.to(torch.int16))


def test_dataloader_workers_stream_and_receive_the_source_exception(cluster):
    # windows 1-2 of each producer's source succeed (generation 1); its third rollout raises
    spec = ScriptedSpec(fault="raise", fault_after=1, fault_worker=1)
    engine = OnlineDataEngine(ray_cfg(spec))
    try:
        engine.start()
        dataset = OnlineDataset(engine, chunk_size=5, batch_size=8, seed=3)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=1,
            multiprocessing_context="spawn",
            collate_fn=OnlineDataset.passthrough_collate_fn,
            timeout=60,
        )
        batches = iter(loader)
        assert_chunks_are_consecutive_frames_of_one_episode(next(batches))
        generation = engine.request_refill()
        with pytest.raises(KeyError, match="scripted failure in rollout"):  # in the owner: original type
            engine.wait_for_generation(generation, timeout=60)
        with pytest.raises(KeyError, match="scripted failure in rollout"):  # in a DataLoader worker too
            for _ in range(100):
                next(batches)
        del batches, loader
        gc.collect()  # the caught exception's frames referenced the iterator: its workers end with it
        assert engine.state is OnlineDataEngineState.FAILED
    finally:
        stop_quietly(engine)


def test_failing_build_makes_start_raise_it(cluster):
    engine = OnlineDataEngine(ray_cfg(ScriptedSpec(fault="build_raise")))
    with pytest.raises(ValueError, match="source could not be built"):
        engine.start()
    stop_quietly(engine)
    assert engine.state is OnlineDataEngineState.FAILED


def test_killed_actor_is_restarted_and_its_window_reissued(cluster):
    with OnlineDataEngine(ray_cfg()) as engine:
        victim = engine.get_stats()["producers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        generation = engine.request_refill()
        engine.wait_for_generation(generation, timeout=90)
        producers = engine.get_stats()["producers"]
        assert producers[0]["restarts"] == 1 and producers[1]["restarts"] == 0
        assert producers[0]["node_id"] == sim_node_id(cluster)
        assert producers[0]["pid"] != victim["pid"]
        assert_chunks_are_consecutive_frames_of_one_episode(engine.sample_batch(32, 6))
        assert engine.get_stats()["successful_episodes"] == 8


def test_exhausted_restarts_fail_the_engine_naming_producer_node_and_error(cluster):
    spec = ScriptedSpec(fault="sigkill", fault_worker=0)  # every incarnation dies in its first rollout
    engine = OnlineDataEngine(ray_cfg(spec))
    with pytest.raises(RayProducerError) as caught:
        engine.start()
    message = str(caught.value)
    assert "producer-0" in message and sim_node_id(cluster) in message
    assert "after 1 restart(s) of max_restarts=1" in message and "Error" in message
    assert isinstance(caught.value, RuntimeError) and caught.value.restarts == 1
    stop_quietly(engine)


def test_a_build_that_hangs_fails_the_start_naming_the_node_its_actor_runs_on(cluster):
    """The actor runs and only its source's build hangs: the error names the node (it said "unknown")."""
    backend = RayBackend(resources={"sim": 1}, start_timeout_s=10.0, max_restarts=0)
    engine = OnlineDataEngine(ray_cfg(ScriptedSpec(fault="build_hang", fault_worker=1), backend))
    with pytest.raises(RayProducerError) as caught:
        engine.start()
    assert str(caught.value).startswith(
        f"Ray producer producer-1 on node {sim_node_id(cluster)}: starting its actor and building its source "
        "did not finish within RayBackend.start_timeout_s=10.0 s"
    ), str(caught.value)
    stop_quietly(engine)


def test_an_actor_lost_inside_its_build_is_named_with_its_node(cluster, tmp_path):
    """The actor ran (its node known from where()) and died inside build(): the error names that node,
    not "unknown (its actor never started)"."""
    stamp = tmp_path / "build"
    spec = ScriptedSpec(fault="build_sigkill", stamp=str(stamp))
    backend = RayBackend(resources={"sim": 1}, restart_delay_s=0.0, max_restarts=0)
    engine = OnlineDataEngine(ray_cfg(spec, backend, num_workers=1))
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            engine.start()
        except BaseException as error:
            outcome.append(error)

    starting = threading.Thread(target=start)
    starting.start()
    try:
        wait_for(stamp.exists, "the build to begin")  # where() was asked with the build: answered by now
    finally:
        (tmp_path / "build.go").touch()
        starting.join(150)
    assert not starting.is_alive() and len(outcome) == 1 and isinstance(outcome[0], RayProducerError), outcome
    error = outcome[0]
    assert str(error).startswith(
        f"Ray producer producer-0 on node {sim_node_id(cluster)}: its actor was lost"
    )
    assert error.node_id == sim_node_id(cluster) and error.restarts == 0
    stop_quietly(engine)


def test_a_source_built_while_the_engine_stops_is_closed(cluster, tmp_path):
    """Producer 0 fails the start while producer 1 is still inside its (slow) build: producer 1's source
    is closed once built, as a local producer's would be, not killed unclosed."""
    log, stamp = tmp_path / "closed", tmp_path / "build"
    spec = ScriptedSpec(
        fault="raise", build_s=(0.0, 8.0), close_log=str(log), stamp=str(stamp),
        fault_after_file=f"{stamp}.1",  # producer 0 fails once producer 1's build has begun
    )  # fmt: skip
    engine = OnlineDataEngine(ray_cfg(spec, shutdown_timeout=30.0))
    with pytest.raises(KeyError, match="scripted failure in rollout"):
        engine.start()
    stop_quietly(engine)
    assert sorted(log.read_text().split()) == ["0", "1"]


def test_hanging_call_fails_the_engine_after_its_timeout_and_stop_ends_the_actor(cluster):
    backend = RayBackend(resources={"sim": 1}, call_timeout_s=2.0, max_restarts=0)
    engine = OnlineDataEngine(ray_cfg(ScriptedSpec(fault="hang", fault_worker=1), backend, num_workers=2))
    with pytest.raises(RayProducerError, match=r"producer-1 on node .*call_timeout_s=2.0"):
        engine.start()
    stop_quietly(engine)  # the autouse fixture checks the hanging actor's resources came back


def test_a_call_of_several_windows_may_take_the_timeout_of_each(cluster):
    """call_timeout_s bounds one window: a call of 4 windows of 0.7 s each (2.8 s) is no hang at 2 s."""
    backend = RayBackend(resources={"sim": 1}, call_timeout_s=2.0, windows_per_call=4, max_restarts=0)
    spec = ScriptedSpec(num_envs=1, rollout_s=0.7)
    with OnlineDataEngine(ray_cfg(spec, backend, num_workers=1)) as engine:
        assert engine.get_stats()["successful_episodes"] == 4


def test_every_window_of_a_call_keeps_its_own_frames(cluster):
    """The actor's rows are rewritten by each window of a call: the windows before the last must leave as
    copies (they once all carried the last window's frames when num_envs was 1)."""
    backend = RayBackend(resources={"sim": 1}, windows_per_call=4)
    with OnlineDataEngine(ray_cfg(ScriptedSpec(num_envs=1), backend, num_workers=1)) as engine:
        first_frames = engine._shared.storage.rows_view()["obs"][:, 0, 0]
        assert first_frames.tolist() == [1_000_000 * 0 + 10 * row for row in range(4)]  # the source's tags


def test_a_call_whose_later_window_fails_publishes_the_windows_before_it(cluster):
    """As a local producer would: window 1 of the call is published, window 2's exception fails the engine."""
    backend = RayBackend(resources={"sim": 1}, windows_per_call=4, max_restarts=0)
    spec = ScriptedSpec(num_envs=1, fault="raise", fault_after=1)
    engine = OnlineDataEngine(ray_cfg(spec, backend, num_workers=1, lifecycle_event_capacity=8))
    with pytest.raises(KeyError, match="scripted failure in rollout"):
        engine.start()
    assert engine._shared.progress.snapshot()["successful_episodes"] == 1
    assert [(e["kind"], e["slot"]) for e in engine._shared.events.drain()] == [("published", 0)]
    stop_quietly(engine)


def test_a_source_sys_exit_fails_the_engine_with_its_message_and_is_not_restarted(cluster):
    spec = ScriptedSpec(fault="sys_exit", fault_after=1, fault_worker=0)
    engine = OnlineDataEngine(ray_cfg(spec))  # max_restarts=1: a lost actor would be restarted
    try:
        engine.start()
        with pytest.raises(OnlineDataWorkerError) as raised:
            engine.wait_for_generation(engine.request_refill(), timeout=60)
        assert str(raised.value) == (
            "Worker producer-0 raised SystemExit: the simulator gave up (it ended that process)"
        )
        assert engine._shared.progress.producer_rows()[0]["restarts"] == 0
    finally:
        stop_quietly(engine)


def test_a_call_that_waits_for_room_in_the_lifecycle_log_is_not_a_hang(cluster):
    """The ingest blocks on a full log until the owner drains it (back-pressure, as locally); calls that
    finished meanwhile must not read as hung when it comes back."""
    backend = RayBackend(
        resources={"sim": 1}, call_timeout_s=2.0, calls_in_flight=1, max_restarts=0, publish_delay_s=0
    )
    spec = ScriptedSpec(rollout_s=0.2)
    cfg = ray_cfg(spec, backend, buffer_size=8, lifecycle_event_capacity=16)  # a refill writes 16 records
    with OnlineDataEngine(cfg) as engine:
        generation = engine.request_refill()
        wait_for(lambda: engine._shared.events.pending() == 16, "a full lifecycle log")
        threading.Event().wait(2 * backend.call_timeout_s)  # the log stays full longer than a call may take
        engine.check_health()
        engine.drain_lifecycle_events()
        engine.wait_for_generation(generation, timeout=60)
        engine.drain_lifecycle_events()
        engine.check_health()


def test_an_actor_runs_at_most_calls_in_flight_windows_ahead_of_the_ingest(cluster, tmp_path):
    """Back-pressure on the actor's stream: while the ingest is held up on a full lifecycle log with one
    window received, the actor rolls out at most ``calls_in_flight`` windows more, then waits; it goes on
    once the owner drains the log."""
    log = tmp_path / "rollouts"
    backend = RayBackend(resources={"sim": 1}, calls_in_flight=2, max_restarts=0, publish_delay_s=0)
    spec = ScriptedSpec(rollout_s=0.05, rollout_log=str(log))  # 20 windows of 2 rows per generation
    cfg = ray_cfg(spec, backend, buffer_size=40, num_workers=1, lifecycle_event_capacity=80)

    def rollouts() -> int:
        return len(log.read_text().splitlines())

    with OnlineDataEngine(cfg) as engine:
        assert rollouts() == 20 and engine._shared.events.pending() == 40  # generation 1's publications
        generation = engine.request_refill()
        wait_for(lambda: engine._shared.events.pending() == 80, "a full lifecycle log")
        # the ingest published the windows whose records fit and holds the next one, waiting for room
        received = int((engine._shared.index.episode_id >= 40).sum()) // 2 + 1
        assert 1 <= received < 20
        wait_for(lambda: rollouts() == 20 + received + 2, "the actor to run 2 windows ahead of the ingest")
        threading.Event().wait(1.0)  # the time of 20 rollouts: none more may start
        assert rollouts() == 20 + received + 2
        engine.drain_lifecycle_events()
        engine.wait_for_generation(generation, timeout=60)
        assert rollouts() == 40
        engine.check_health()


def test_a_failed_publication_still_lets_stop_close_a_source_held_by_back_pressure(cluster):
    """A window with an unwritten frame fails the ingest while its actor waits, items ahead, for room on
    its stream. The failure's traceback (kept on the error channel) kept the stream alive, so the actor
    never saw the stop, its close() never ran, and stop() killed it with a durability note. The ingest
    now takes the waiting items at shutdown."""
    backend = RayBackend(resources={"sim": 1}, calls_in_flight=2, max_restarts=0, publish_delay_s=0)
    spec = ScriptedSpec(fault="unwritten", fault_after=2, close_s=0.2)  # close() runs for a moment
    engine = OnlineDataEngine(ray_cfg(spec, backend, num_workers=1, buffer_size=40, shutdown_timeout=5.0))
    with pytest.raises(ValueError, match=r"buffer row 5 \(row 1 of the rollout\)") as failure:
        engine.start()
    stop_quietly(engine)
    assert engine._shared.channel.notes() == []  # no "did not close its source in time and was killed"
    assert "recorder durability could not be confirmed" not in "".join(
        getattr(failure.value, "__notes__", [])
    )


def test_stats_show_no_live_actor_while_a_lost_one_is_replaced(cluster):
    backend = RayBackend(resources={"sim": 1}, restart_delay_s=3600.0, max_restarts=1)
    with OnlineDataEngine(ray_cfg(backend=backend, num_workers=1, buffer_size=2)) as engine:
        victim = engine.get_stats()["producers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        engine.request_refill()
        wait_for(lambda: engine.get_stats()["producers"][0]["restarts"] == 1, "the loss to be seen")
        producer = engine.get_stats()["producers"][0]
        assert producer["pid"] == 0 and producer["node_id"] is None and not producer["alive"]


def test_stop_returns_the_sim_resources(cluster):
    engine = OnlineDataEngine(ray_cfg())
    engine.start()
    wait_for(
        lambda: sim_available() == SIM_CPUS - 2, "the view of the producers' resources"
    )  # updated asynchronously
    engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED
    wait_for(lambda: sim_available() == SIM_CPUS, "the actors' resources after stop()")


def test_shutdown_closes_sources_whose_build_finished_unreceived(cluster):
    """A stop between an actor's build finishing and the ingest receiving it still closes that source
    (here the ingest never runs: the builds finish, then it shuts down)."""
    import ray

    from simstream.ray.ingest import RayProducers

    cfg = ray_cfg(ScriptedSpec(close_fault="raise"))
    engine = OnlineDataEngine(cfg)  # never started: its shared objects only
    try:
        producers = RayProducers(engine._shared, cfg, 2, engine._spec_bytes, None)
        producers.start()
        builds = [producer.build_ref for producer in producers._producers]
        ready, _ = ray.wait(builds, num_returns=len(builds), timeout=120)
        assert len(ready) == 2 and all(p.build_ref is not None for p in producers._producers)
        report = producers.shutdown(10.0)
        assert not report.forced
        error = engine._shared.channel.error()
        assert isinstance(error, OSError) and "flush failed while closing the source" in str(error)
        assert "producer-1: source close() also failed: OSError" in "".join(engine._shared.channel.notes())
        assert all(producer.actor is None for producer in producers._producers)
    finally:
        stop_quietly(engine)


_STOP_DURING_RAY_INIT = """
import sys, threading, time
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.ray import RayBackend
from tests.ray_backend.conftest import ray_processes, wait_for
from tests.support.sources import ScriptedSpec

if __name__ == "__main__":
    # a cluster of its own ("local"): the ingest's ray.init starts one, which takes seconds
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, num_workers=1, refill_policy="manual",
                              shutdown_timeout=1.0, initialization_timeout=120.0,
                              backend=RayBackend(address="local", num_cpus=0))
    engine = OnlineDataEngine(cfg)
    refusals = []

    def start():
        try:
            engine.start()
        except RuntimeError as error:
            refusals.append(str(error))

    starter = threading.Thread(target=start)
    starter.start()
    if sys.argv[1] == "inside":  # the cluster's first processes are up: ray.init is under way
        wait_for(lambda: ray_processes(), "the ingest's ray.init", 120)
    else:  # the ingest is launched, and still starting (imports) or about to call ray.init
        wait_for(lambda: engine._ray_joining is not None, "the ingest's launch")
    engine.stop()
    starter.join(60)
    wait_for(lambda: not ray_processes(), "the ingest's own cluster to end")
    print(engine.state.value, refusals, flush=True)
"""


@pytest.mark.parametrize("moment", ["inside", "before"])
def test_a_stop_while_the_ingest_starts_its_own_cluster_waits_for_it_and_stays_clean(
    cluster, tmp_path, moment
):
    """``ray.init`` cannot be interrupted: the stop waits for it instead of terminating the ingest past its
    exit bound (which failed the engine with a durability error). A stop before it (the ingest still
    importing) is seen by the ingest, which then never connects; it went on into ray.init, was terminated
    there, and left Ray's agents running."""
    script = tmp_path / "stop_during_init.py"
    script.write_text(_STOP_DURING_RAY_INIT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, str(script), moment], cwd=root, capture_output=True, text=True, timeout=150,
        check=False, env={**env, "PYTHONPATH": root},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "STOPPED ['OnlineDataEngine.start() was cancelled by stop().']", (
        result.stdout + result.stderr[-3000:]
    )
    assert "did not exit in time" not in result.stderr, result.stderr[-3000:]


_INGEST_KILLED_WITH_ITS_CLUSTER = """
import os, signal, sys
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.ray import RayBackend
from tests.ray_backend.conftest import _descendants, wait_for
from tests.support.sources import ScriptedSpec

if __name__ == "__main__":
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, num_workers=1, refill_policy="manual",
                              shutdown_timeout=1.0, initialization_timeout=120.0,
                              backend=RayBackend(address="local", num_cpus=1))
    engine = OnlineDataEngine(cfg)
    engine.start()
    ingest = engine._supervisor.processes["ray-ingest"].pid
    started = _descendants(ingest)  # the cluster its ray.init started: GCS, raylet, agents, workers
    assert any("raylet" in name for name in started.values()), started
    os.kill(ingest, signal.SIGKILL)  # the OOM killer, say: nothing of Ray's own shutdown runs
    try:
        engine.stop()
    except RuntimeError as error:
        print("FAILED:", str(error).splitlines()[0], flush=True)

    def alive() -> dict:
        left = {}
        for pid, name in started.items():
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    if handle.read().rsplit(") ", 1)[1][0] != "Z":
                        left[pid] = name
            except OSError:
                pass
        return left

    wait_for(lambda: not alive(), "the killed ingest's cluster to end", 20)  # its agents took ~60 s
    print("CLEAN", len(started), flush=True)
"""


def test_an_ingest_killed_with_the_cluster_it_started_leaves_no_ray_process(cluster, tmp_path):
    """A SIGKILLed ingest runs none of Ray's shutdown: its GCS and raylet end on their own, but the
    dashboard and runtime-env agents lived on for a minute. The ingest leads a process group of its own,
    which the owner's stop() kills."""
    script = tmp_path / "ingest_killed.py"
    script.write_text(_INGEST_KILLED_WITH_ITS_CLUSTER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=150, check=False,
        env={**env, "PYTHONPATH": root},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "FAILED: OnlineDataEngine simulation worker exited unexpectedly (exit code -9" in result.stdout
    assert "CLEAN" in result.stdout, result.stdout + result.stderr[-3000:]


_OWNER_KILLED_SCRIPT = """
import multiprocessing as mp, sys, threading
import ray
from simstream import OnlineDataEngine, OnlineDataEngineCfg
from simstream.ray import RayBackend
from tests.support.consumers import sample_until_it_fails
from tests.support.sources import ScriptedSpec


if __name__ == "__main__":
    ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, num_workers=2,
                              backend=RayBackend(resources={"sim": 1}), initialization_timeout=120.0)
    engine = OnlineDataEngine(cfg)
    engine.start()
    ready = mp.get_context("spawn").Event()
    consumer = mp.get_context("spawn").Process(target=sample_until_it_fails, args=(engine, ready))
    consumer.start()
    ready.wait(120)
    print("ready", flush=True)
    threading.Event().wait(600)
"""


def test_owner_killed_leaves_no_actor_running_and_its_consumers_get_an_error(cluster, tmp_path):
    """The ingest leaves with its owner, ends the actors, and says why: a consumer the owner started raises
    it instead of sampling a buffer that never changes again (state READY, refills never served)."""
    import ray

    script = tmp_path / "owner.py"
    script.write_text(_OWNER_KILLED_SCRIPT)
    out_path = tmp_path / "out.txt"
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    # a file, not a pipe: the orphaned consumer holds it open after the owner has ended
    with open(out_path, "w") as out:
        owner = subprocess.Popen(
            [sys.executable, str(script), ray.get_runtime_context().gcs_address],
            stdout=out, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, "PYTHONPATH": root},
        )  # fmt: skip
    try:
        wait_for(lambda: "ready" in out_path.read_text(), "the owner to start its engine and consumer", 120)
        wait_for(
            lambda: sim_available() == SIM_CPUS - 2, "the view of the producers' resources"
        )  # updated asynchronously
        owner.kill()
        owner.wait(30)
        wait_for(lambda: sim_available() == SIM_CPUS, "the dead owner's actors to end")
        wait_for(lambda: "consumer:" in out_path.read_text(), "the orphaned consumer's answer")
    finally:
        owner.kill()
        owner.wait(30)
    line = next(line for line in out_path.read_text().splitlines() if line.startswith("consumer:"))
    assert line.startswith("consumer: FAILED OnlineDataWorkerError OnlineDataEngine owner process "), line
    assert "exited without stop(): the producers stopped with it" in line


def test_stream_command_runs_its_producers_as_ray_actors(cluster):
    import ray

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    command = [sys.executable, "-m", "simstream", "stream", "--backend", "ray", "--seconds", "1"]
    command += ["--num-workers", "1", "--buffer-size", "8", "--batch-size", "4", "--chunk-size", "4"]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 producer(s) as Ray actors" in result.stdout and "batches/s" in result.stdout


def test_record_command_runs_its_producers_as_ray_actors(cluster, tmp_path):
    import ray

    from simstream.lerobot.dataset import read_dataset_meta

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    out = tmp_path / "ds"
    command = [sys.executable, "-m", "simstream", "record", "--backend", "ray", "--episodes", "2"]
    command += ["--num-workers", "1", "--out", str(out)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    meta = read_dataset_meta(out)
    assert meta.info["total_episodes"] == 2 and meta.info["fps"] == 20
    assert all(int(episode["length"]) > 0 for episode in meta.episodes)


def test_script_that_never_stops_its_engine_closes_the_sources_at_exit(cluster):
    import ray

    script = textwrap.dedent(
        f"""
        import ray
        from simstream import OnlineDataEngine, OnlineDataEngineCfg
        from simstream.ray import RayBackend
        from tests.support.sources import ScriptedSpec
        ray.init(address={ray.get_runtime_context().gcs_address!r}, logging_level="WARNING",
                 log_to_driver=False)
        cfg = OnlineDataEngineCfg(source=ScriptedSpec(close_fault="raise"), buffer_size=4, num_workers=2,
                                  backend=RayBackend(resources={{"sim": 1}}), initialization_timeout=120.0)
        engine = OnlineDataEngine(cfg)
        engine.start()
        print("started", flush=True)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=150, check=False
    )
    assert result.stdout.strip() == "started", result.stderr[-3000:]
    # the exit hook stopped the engine before Ray disconnected: each source's close() ran (and raised)
    assert "OSError: flush failed while closing the source" in result.stderr
    wait_for(lambda: sim_available() == SIM_CPUS, "the script's actors to end")


def test_an_actor_lost_while_idle_is_restarted_without_a_refill_and_stop_stays_clean(cluster):
    """No window call is outstanding to report the loss: the actor's watch call does."""
    with OnlineDataEngine(ray_cfg()) as engine:  # manual refills: idle after the first fill
        victim = engine.get_stats()["producers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(
            lambda: engine.get_stats()["producers"][0]["restarts"] == 1, "the idle actor's loss to be seen"
        )
        wait_for(
            lambda: engine.get_stats()["producers"][0]["pid"] not in (0, victim["pid"]), "its replacement"
        )
        producers = engine.get_stats()["producers"]
        assert producers[0]["alive"] and producers[0]["node_id"] == sim_node_id(cluster)
        assert producers[1]["restarts"] == 0
        engine.check_health()
    assert engine.state is OnlineDataEngineState.STOPPED


def test_a_source_close_may_take_nearly_all_of_shutdown_timeout(cluster):
    """As a local producer's: the ingest kills its actors and leaves Ray after the closes, not within."""
    engine = OnlineDataEngine(ray_cfg(ScriptedSpec(close_s=3.0), shutdown_timeout=5.0))
    engine.start()
    engine.stop()
    assert engine.state is OnlineDataEngineState.STOPPED


def test_an_error_the_trainer_cannot_unpickle_fails_the_engine_instead_of_restarting(cluster, tmp_path):
    """Its class exists only where the producer runs: Ray's UnserializableException is not a lost actor."""
    (tmp_path / "simstream_node_only_error.py").write_text("class NodeOnlyError(Exception):\n    pass\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(tmp_path), root])}}
    backend = RayBackend(resources={"sim": 1}, max_restarts=2, restart_delay_s=0.0, runtime_env=runtime_env)
    engine = OnlineDataEngine(ray_cfg(ScriptedSpec(fault="node_only"), backend, num_workers=1))
    try:
        with pytest.raises(RayProducerError) as raised:
            engine.start()
        message = str(raised.value)
        assert message.startswith(f"Ray producer producer-0 on node {sim_node_id(cluster)}: Ray could not ")
        assert (
            "UnserializableException" in message and "failed after 0 restart(s) of max_restarts=2" in message
        )
        assert raised.value.restarts == 0
    finally:
        stop_quietly(engine)


MAIN_SCRIPT = """
import sys
from dataclasses import dataclass

import ray

from simstream import Episode, Field, OnlineDataEngine, OnlineDataEngineCfg
from simstream.ray import RayBackend


class SimulatorCrashed(Exception):
    pass


class Source:
    def __init__(self, fail_at):
        self.fail_at, self.rollouts = fail_at, 0

    def rollout(self, rows, *, attempt, should_stop):
        self.rollouts += 1
        if self.rollouts >= self.fail_at:
            raise SimulatorCrashed("physics exploded at step 3")
        rows["obs"][0, :5] = 1.0
        rows["actions"][0, :5] = 0.0
        return [Episode(length=5)]

    def close(self):
        pass


@dataclass(frozen=True)
class Spec:
    fail_at: int = 1
    num_envs: int = 1
    max_episode_steps: int = 5

    def fields(self):
        return {"obs": Field((2,)), "actions": Field((2,))}

    def build(self, worker_index, seed):
        return Source(self.fail_at)


if __name__ == "__main__":
    ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
    windows = int(sys.argv[2])  # 2: the second window of the first call fails, after the first arrived
    backend = RayBackend(resources={"sim": 1}, max_restarts=0, windows_per_call=windows)
    cfg = OnlineDataEngineCfg(
        source=Spec(fail_at=windows), buffer_size=2, shutdown_timeout=10.0, initialization_timeout=120.0,
        backend=backend,
    )
    engine = OnlineDataEngine(cfg)
    try:
        engine.start()
    except SimulatorCrashed as error:
        print("caught", type(error).__module__, type(error).__qualname__, error, flush=True)
    finally:
        try:
            engine.stop()
        except SimulatorCrashed:
            pass
"""


@pytest.mark.parametrize("windows_per_call", [1, 2])
def test_an_exception_class_of_the_users_script_reaches_it_as_itself(cluster, tmp_path, windows_per_call):
    """Ray moves a class of the script's ``__main__`` by value; the owner still catches its own class, also
    when a later window of a call fails (it came as an ``OnlineDataWorkerError`` then)."""
    import ray

    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    address = ray.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, str(script), address, str(windows_per_call)], cwd=root, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    assert result.stdout.strip() == "caught __main__ SimulatorCrashed physics exploded at step 3", (
        result.stdout + result.stderr[-3000:]
    )
    wait_for(lambda: sim_available() == SIM_CPUS, "the script's actors to end")


def test_sim_node_lost_and_added_again(cluster):
    """Last in the module: it replaces the cluster's sim node."""
    ray_cluster, sim_node = cluster
    backend = RayBackend(resources={"sim": 1}, max_restarts=2, restart_delay_s=0.0)
    with OnlineDataEngine(ray_cfg(backend=backend)) as engine:
        ray_cluster.remove_node(sim_node)
        generation = engine.request_refill()  # its calls find the actors gone
        wait_for(
            lambda: all(p["restarts"] == 1 for p in engine.get_stats()["producers"]),
            "both producers to notice the lost node and ask for new actors",
        )
        new_node = ray_cluster.add_node(
            num_cpus=SIM_CPUS, resources={"sim": SIM_CPUS}, object_store_memory=200 * 2**20
        )
        engine.wait_for_generation(generation, timeout=120)
        producers = engine.get_stats()["producers"]
        assert [p["node_id"] for p in producers] == [new_node.node_id] * 2
        assert [p["restarts"] for p in producers] == [1, 1]
        assert_chunks_are_consecutive_frames_of_one_episode(engine.sample_batch(32, 6))
