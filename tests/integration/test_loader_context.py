"""``OnlineDataset.loader`` and ``loader_context``: DataLoader workers whose queues have no feeder thread."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simstream import OnlineDataEngine
from simstream.data import OnlineDataset, loader_context
from simstream.data.loader_context import DirectQueue
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec, assert_whole_chunks

pytestmark = pytest.mark.timeout(120)


def _feeder_threads() -> list[str]:
    """multiprocessing.Queue's feeder threads and DirectQueue's fallback ones, in this process."""
    return [thread.name for thread in threading.enumerate() if "feeder" in thread.name.lower()]


def _refilling_engine(spec: ScriptedSpec | None = None) -> OnlineDataEngine:
    spec = spec or ScriptedSpec(lengths=(20, 9))
    return OnlineDataEngine(make_cfg(spec, buffer_size=6, refill_threshold=1))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_loader_streams_whole_batches_without_feeder_threads(method):
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=3)
        loader = dataset.loader(num_workers=2, multiprocessing_context=method, timeout=60)
        assert loader.multiprocessing_context.get_start_method() == method
        assert type(loader.multiprocessing_context).__name__.startswith("Direct")
        iterator = iter(loader)
        try:
            workers = set()
            for _ in range(30):
                batch = next(iterator)
                assert batch.batch_size == torch.Size([8, 4])
                assert_whole_chunks(batch)
                workers.update(batch["obs"][..., 2].unique().tolist())
            # the trainer put 30+ indices into the workers' queues: a multiprocessing.Queue would have
            # started a feeder thread here for each of them
            assert _feeder_threads() == []
        finally:
            iterator._shutdown_workers()
        assert engine.get_stats()["requested_generation"] >= 2  # the workers' samples triggered refills


def test_item_mode_loader_collates_chunks():
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=5, seed=1)
        loader = dataset.loader(num_workers=2, batch_size=6, timeout=60)
        iterator = iter(loader)
        try:
            for _ in range(8):
                batch = next(iterator)
                assert batch.batch_size == torch.Size([6, 5])
                assert_whole_chunks(batch)
        finally:
            iterator._shutdown_workers()


def test_loader_without_workers_samples_in_process():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        dataset = OnlineDataset(engine, chunk_size=3, batch_size=4, seed=7)
        first = next(iter(dataset.loader()))
        again = next(iter(OnlineDataset(engine, chunk_size=3, batch_size=4, seed=7)))
        assert (first == again).all()


def _fail_in_the_worker(batch):
    raise ValueError("transform failed in the worker")


def _failing_loader(engine: OnlineDataEngine):
    """Two fork workers whose transform raises on every batch."""
    return OnlineDataset(engine, chunk_size=2, batch_size=4, transform=_fail_in_the_worker).loader(
        num_workers=2, multiprocessing_context="fork", timeout=60
    )


def test_an_error_in_a_worker_reaches_the_trainer_with_its_type_and_message():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        iterator = iter(_failing_loader(engine))
        try:
            with pytest.raises(ValueError, match="transform failed in the worker"):
                next(iterator)
        finally:
            iterator._shutdown_workers()


def test_a_producer_failure_reaches_the_trainer_through_the_workers():
    spec = ScriptedSpec(lengths=(20, 9), fault="raise", fault_after=3)
    with pytest.raises(KeyError, match="scripted failure in rollout"), _refilling_engine(spec) as engine:
        iterator = iter(OnlineDataset(engine, chunk_size=2, batch_size=4).loader(num_workers=2, timeout=60))
        try:
            for _ in range(100_000):  # refills requested by the workers' samples reach the fault
                next(iterator)
        finally:
            iterator._shutdown_workers()


def test_a_producer_sys_exit_reaches_the_trainer_through_the_workers_as_a_worker_error():
    """A DataLoader worker catches only Exception: a producer's SystemExit re-raised as it is would end the
    worker ("exited unexpectedly ... Details are lost"). It arrives wrapped in OnlineDataWorkerError."""
    from simstream import OnlineDataWorkerError

    spec = ScriptedSpec(lengths=(20, 9), fault="sys_exit", fault_after=3)
    with pytest.raises(OnlineDataWorkerError) as raised, _refilling_engine(spec) as engine:
        iterator = iter(OnlineDataset(engine, chunk_size=2, batch_size=4).loader(num_workers=2, timeout=60))
        try:
            for _ in range(100_000):
                next(iterator)
        finally:
            iterator._shutdown_workers()
    # torch re-raises the worker's exception with its own preamble and the original traceback
    assert "Worker producer-0 raised SystemExit: the simulator gave up (it ended that process)" in str(
        raised.value
    )


def test_a_killed_worker_is_reported_not_waited_for():
    """DataLoader's own watchdog still works with direct queues: an error, not a hang.

    Which error depends on where the kill lands: DataLoader's SIGCHLD handler (at any line after the kill,
    even during shutdown), its liveness check, or a batch whose storage the dead worker was handing over.
    """
    errors: list[BaseException] = []
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        loader = OnlineDataset(engine, chunk_size=2, batch_size=4).loader(
            num_workers=2, multiprocessing_context="fork", timeout=30
        )
        iterator = iter(loader)
        try:
            next(iterator)
            os.kill(iterator._workers[0].pid, signal.SIGKILL)
            for _ in range(100_000):
                next(iterator)
        except (RuntimeError, ConnectionError, EOFError) as error:
            errors.append(error)
        finally:
            try:
                iterator._shutdown_workers()
            except RuntimeError as error:
                errors.append(error)
    assert errors, "the loader kept delivering batches after a worker was killed"
    reported = re.compile(
        r"DataLoader worker \(pids?(\(s\))? [\d, ]+\) (is killed by signal: Killed|exited unexpectedly)"
    )
    assert all(isinstance(e, (ConnectionError, EOFError)) or reported.search(str(e)) for e in errors), errors


# -- the queue itself ----------------------------------------------------------------------------------
def _echo(inbox: DirectQueue, outbox: DirectQueue) -> None:
    while (item := inbox.get(timeout=30)) is not None:
        outbox.put({"doubled": item * 2, "pid": os.getpid()})


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_direct_queue_carries_objects_and_tensors_between_processes(method):
    context = loader_context(method)
    inbox, outbox = context.Queue(), context.Queue()
    process = context.Process(target=_echo, args=(inbox, outbox))
    process.start()
    try:
        inbox.put(torch.arange(3))
        inbox.put(21)
        first, second = outbox.get(timeout=30), outbox.get(timeout=30)
        assert first["doubled"].tolist() == [0, 2, 4] and second["doubled"] == 42
        assert first["pid"] == process.pid != os.getpid()
        inbox.put(None)
        process.join(timeout=30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join()
    assert _feeder_threads() == []


def test_direct_queue_timeouts_and_close():
    direct = loader_context("fork").Queue()
    with pytest.raises(queue.Empty):
        direct.get(block=False)
    with pytest.raises(queue.Empty):
        direct.get(timeout=0.01)
    direct.put("kept in order")
    direct.put(("a", 2))
    assert direct.get(timeout=1) == "kept in order" and direct.get() == ("a", 2)
    direct.close()
    direct.close()
    with pytest.raises(ValueError, match="put\\(\\) on a closed DirectQueue"):
        direct.put(1)
    with pytest.raises(ValueError, match="get\\(\\) on a closed DirectQueue"):
        direct.get()


def _hold_write_lock(direct: DirectQueue, holding, release) -> None:
    with direct._write_lock:  # as a writer stuck on a full pipe that nobody reads any more
        holding.set()
        release.wait(30)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_put_never_waits_for_another_writer(method):
    """DataLoader puts a wake-up into the result queue at shutdown: a stuck worker must not hang it."""
    context = loader_context(method)
    direct, holding, release = context.Queue(), context.Event(), context.Event()
    holder = context.Process(target=_hold_write_lock, args=(direct, holding, release))
    holder.start()
    try:
        assert holding.wait(30)
        direct.put((None, None))  # returns at once: the message waits in this process's feeder thread
        assert _feeder_threads() == ["DirectQueue-feeder"]
        release.set()
        assert direct.get(timeout=30) == (None, None)
    finally:
        release.set()
        holder.join(30)
        direct.close()


def test_large_and_small_messages_keep_their_order():
    direct = loader_context("fork").Queue()
    big = bytes(256 * 1024)  # four times a pipe: it can only be written while someone reads
    messages = ["small", big, "after the big one", big, 7]
    for message in messages:
        direct.put(message)  # never blocks, although nobody reads yet
    received = [direct.get(timeout=30) for _ in messages]
    assert received == messages
    direct.close()


def test_small_messages_that_no_longer_fit_the_pipe_go_through_the_feeder():
    """Many workers with deep prefetching can fill the result pipe while the trainer is busy: a direct
    write would block holding the write lock, and the worker would miss the shutdown (5 s per stop)."""
    direct = loader_context("fork").Queue()
    small = "x" * 3000  # a direct write's size
    sent = 0
    while direct._feeder is None:  # fill the pipe by direct writes until one does not fit
        direct.put(small)
        sent += 1
        assert sent < 1000, "the pipe never filled"
    assert _feeder_threads() == ["DirectQueue-feeder"] and sent >= 5
    received = [direct.get(timeout=30) for _ in range(sent)]  # reading drains the feeder's backlog too
    assert received == [small] * sent
    direct.close()
    direct._feeder.join(5)  # it leaves within a slice of the close


class _BigResult:
    """A transform whose result travels by value (1 MiB of NumPy), larger than the result pipe."""

    def __call__(self, batch):
        return batch["obs"].numpy().repeat(4096, axis=0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_with_large_results_exit_on_their_own_when_the_loop_stops_early(method):
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=3, transform=_BigResult())
        loader = dataset.loader(num_workers=2, multiprocessing_context=method, timeout=60)
        iterator = iter(loader)
        workers = list(iterator._workers)
        try:
            for _ in range(2):
                assert next(iterator).nbytes >= 1 << 20
        finally:
            iterator._shutdown_workers()  # what breaking out of the loop does
        # a worker blocked writing its result would only have ended by DataLoader's terminate()
        assert [worker.exitcode for worker in workers] == [0, 0]


def test_cancel_join_thread_lets_close_skip_the_feeder(monkeypatch):
    """A DataLoader worker calls ``cancel_join_thread()`` at shutdown: its ``close()`` (and its exit) must not
    wait for a feeder stuck on a result pipe the trainer reads no more (it held every worker's exit, and
    so the loader's shutdown, for 5 s). The wait is made far longer here than the test's bound."""
    module = sys.modules[DirectQueue.__module__]  # the package exports a function of the same name

    monkeypatch.setattr(module, "_CLOSE_WAIT_S", 600.0)
    direct = DirectQueue(mp.get_context("fork"))
    for _ in range(4):  # 4 MiB into a 64 KiB pipe nobody reads: the feeder blocks in its first write
        direct.put(bytes(1 << 20))
    feeder = direct._feeder
    direct.cancel_join_thread()
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (direct.close(), closed.set()), daemon=True)
    closer.start()
    assert closed.wait(60), "close() waited for the blocked feeder"
    feeder.join(60)  # with the read end closed too its write fails (EPIPE), and it ends
    assert not feeder.is_alive()


def _write_half_a_message_and_die(direct: DirectQueue) -> None:
    whole = ForkingPickler.dumps(bytes(100_000))
    os.write(direct._writer.fileno(), struct.pack("!i", len(whole)) + whole[:1000])
    os.kill(os.getpid(), signal.SIGKILL)  # killed halfway through writing (the OOM killer, say)


def test_a_get_with_a_timeout_is_bounded_inside_a_torn_message():
    """A writer killed mid-message never sends the rest: the reader's get still returns at its timeout."""
    context = loader_context("fork")
    direct = context.Queue()
    writer = context.Process(target=_write_half_a_message_and_die, args=(direct,))
    writer.start()
    writer.join(30)
    assert writer.exitcode == -signal.SIGKILL
    with pytest.raises(queue.Empty):
        direct.get(timeout=0.2)
    with pytest.raises(queue.Empty):  # and again: the part read so far is kept, nothing else arrives
        direct.get(timeout=0.2)
    direct.close()


def test_huge_and_many_messages_are_framed_like_multiprocessing_connection():
    direct = loader_context("fork").Queue()
    received = []
    reader = threading.Thread(target=lambda: received.extend(direct.get(timeout=30) for _ in range(3)))
    reader.start()
    for message in (b"a" * 5, bytes(3 * 1024 * 1024), {"n": 3}):
        direct.put(message)
    reader.join(60)
    assert received == [b"a" * 5, bytes(3 * 1024 * 1024), {"n": 3}]
    direct.close()


def test_loader_context_does_not_pin_the_default_start_method():
    code = (
        "import multiprocessing as mp; from simstream.data import loader_context; "
        "context = loader_context(); "
        "print(context.get_start_method(), mp.get_start_method(allow_none=True))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [mp.get_all_start_methods()[0], "None"]


def test_loader_argument_errors():
    batches = OnlineDataset(None, chunk_size=2, batch_size=4)
    items = OnlineDataset(None, chunk_size=2)
    with pytest.raises(ValueError, match=r"batch_size must be None in batch mode: .* batches of 4 chunks"):
        batches.loader(batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1 in item mode .*got None"):
        items.loader()
    with pytest.raises(ValueError, match="start_method must be None or one of"):
        loader_context("threads")


def test_chunk_sizes_the_engine_cannot_serve_are_refused_when_the_dataset_is_made():
    from simstream.data import GMMChunkSampler, UniformChunkSampler

    with OnlineDataEngine(make_cfg(ScriptedSpec(max_episode_steps=20), refill_policy="manual")) as engine:
        with pytest.raises(ValueError, match=r"chunk_size must be in \[1, max_episode_steps = 20\], got 30"):
            OnlineDataset(engine, chunk_size=30, batch_size=4)
        with pytest.raises(
            ValueError, match=r"UniformChunkSampler\(low=5, high=30\) can draw up to 30; a chunk"
        ):
            OnlineDataset(engine, chunk_size=UniformChunkSampler(5, 30), batch_size=4)
        with pytest.raises(
            ValueError, match=r"GMMChunkSampler\(.*\) can draw any size; .* give it high <= 20"
        ):
            OnlineDataset(engine, chunk_size=GMMChunkSampler([8], [3]), batch_size=4)
        with pytest.raises(ValueError, match=r"sampling_mode='boundary' needs chunk_size >= 2, got 1"):
            OnlineDataset(engine, chunk_size=1, batch_size=4, sampling_mode="boundary")
        with pytest.raises(ValueError, match=r"boundary.*UniformChunkSampler\(low=1, high=4\) can be 1"):
            OnlineDataset(
                engine, chunk_size=UniformChunkSampler(1, 4), batch_size=4, sampling_mode="boundary"
            )
        OnlineDataset(engine, chunk_size=GMMChunkSampler([8], [3], high=20), batch_size=4)  # bounded: fine
        OnlineDataset(engine, chunk_size=20, batch_size=4)


# torch warns that 3 workers exceed 2 CPUs; this test never starts them
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@given(st.integers(min_value=-3, max_value=3))
@settings(deadline=None)  # a loaded CI machine may stall one example past the default
def test_loader_num_workers_range(workers):
    dataset = OnlineDataset(None, chunk_size=2, batch_size=4)
    if workers < 0:
        with pytest.raises(ValueError, match=rf"num_workers must be an int >= 0, got {workers}"):
            dataset.loader(num_workers=workers)
    else:
        loader = dataset.loader(num_workers=workers)
        assert loader.num_workers == workers and loader.batch_size is None
        assert (loader.multiprocessing_context is None) == (workers == 0)


def test_releasing_exited_workers_never_waits_for_a_lock_its_own_thread_holds():
    """The cyclic collector can finalise an earlier iterator (left in a cycle by a worker's exception)
    inside an arrival, which holds the registry's lock: the release waited for it forever (the trainer
    hung). It now leaves the pruning to the next arrival."""
    from types import SimpleNamespace

    from simstream.data import worker_slots as slots_module

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    with slots_module._RECEIVED_LOCK:
        slots_module.release_exited_workers()  # returns at once
        assert slots_module._prune_wanted
        stale = SimpleNamespace(pid=dead_pid, release_unused=lambda idle: None)
        slots_module._RECEIVED[(dead_pid, "stale")] = stale
    with _refilling_engine() as engine:
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=1).loader(num_workers=1, timeout=60)
        iterator = iter(loader)
        next(iterator)  # an arrival: it prunes the exited worker's pool
        assert not slots_module._prune_wanted and (dead_pid, "stale") not in slots_module._RECEIVED
        del iterator


def test_the_slots_of_a_worker_that_exited_unreaped_are_released():
    """torch gives a worker that is slow to stop 5 s, then terminates it without reaping it: its slots
    stayed mapped in the trainer while it was a zombie, which ``os.kill(pid, 0)`` reads as alive."""
    from types import SimpleNamespace

    from simstream._sync import process_state
    from simstream.data import worker_slots as slots_module

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while process_state(zombie.pid) != "Z":  # a bounded poll: nothing tells when a child has exited
            assert time.monotonic() < deadline, "the child never exited"
            threading.Event().wait(0.01)
        for pid in (zombie.pid, live.pid):
            slots_module._RECEIVED[(pid, "pool")] = SimpleNamespace(pid=pid, release_unused=lambda idle: None)
        slots_module.release_exited_workers()
        assert (zombie.pid, "pool") not in slots_module._RECEIVED
        assert (live.pid, "pool") in slots_module._RECEIVED
    finally:
        for pid in (zombie.pid, live.pid):
            slots_module._RECEIVED.pop((pid, "pool"), None)
        live.communicate(timeout=30)
        zombie.wait(30)


def test_persistent_workers_draw_fresh_windows_every_epoch():
    """Without a seed, a persistent worker seeded each epoch from torch.initial_seed(), which never
    changes in its process: every epoch repeated the first one's draws exactly."""
    with OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 9)), buffer_size=6)) as engine:  # no refills
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8).loader(
            num_workers=1, persistent_workers=True, timeout=60
        )
        firsts = [next(iter(loader))["obs"].clone() for _ in range(3)]
        del loader
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])


_user_init_ran: list[int] = []


def _user_init(worker_id: int) -> None:
    _user_init_ran.append(worker_id)


class _WhatTheWorkerSees:
    """A transform reporting the worker's frozen object count and whether the user's init ran."""

    def __call__(self, batch):
        import gc

        return torch.tensor([gc.get_freeze_count(), len(_user_init_ran)])


def test_workers_freeze_what_they_inherited_and_still_run_the_users_init():
    """A forked worker collecting the trainer's inherited garbage (an earlier iterator) ran its __del__,
    which shut down queues that were not the worker's own and stalled the DataLoader."""
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=2, transform=_WhatTheWorkerSees())
        loader = dataset.loader(num_workers=1, multiprocessing_context="fork", worker_init_fn=_user_init)
        frozen, ran = next(iter(loader)).tolist()
    assert frozen > 1000 and ran == 1
    assert _user_init_ran == []  # it ran in the worker


def _put_last_words_and_exit(direct: DirectQueue, put_done) -> None:
    direct.put("last words")  # the write lock is busy: it waits in this process's feeder thread
    put_done.set()
    # returns without close(), as a DataLoader worker whose dataset ran out does


def test_a_worker_that_exits_without_closing_lets_its_feeder_finish_first():
    """A daemon feeder was killed with its process: its message was lost, and killed inside a write it
    kept the write lock for good, so the other workers could never send again (a stalled loader, about
    one run in four of a loop that iterated again after a worker's exception)."""
    context = loader_context("fork")
    direct, put_done = context.Queue(), context.Event()
    assert direct._write_lock.acquire(timeout=10)  # another writer, mid-message
    child = context.Process(target=_put_last_words_and_exit, args=(direct, put_done))
    child.start()
    try:
        assert put_done.wait(60)
        direct._write_lock.release()
        assert direct.get(timeout=30) == "last words"
        child.join(30)
        assert child.exitcode == 0
        assert direct._write_lock.acquire(False), "the exited worker kept the write lock"
        direct._write_lock.release()
    finally:
        child.join(30)
        direct.close()


_TRAINER = """
import sys, threading
from simstream import OnlineDataEngine
from simstream.data import OnlineDataset
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec

if __name__ == "__main__":
    engine = OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 9)), buffer_size=6, refill_threshold=1))
    engine.start()
    dataset = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=3)
    iterator = iter(dataset.loader(num_workers=2, multiprocessing_context=sys.argv[1], timeout=60))
    next(iterator)
    print(" ".join(str(worker.pid) for worker in iterator._workers), flush=True)
    threading.Event().wait(600)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_end_with_a_killed_trainer(method, tmp_path):
    """Under forkserver the workers' parent is the fork server, which they keep alive: torch's check of
    the parent pid never fired, and the workers of a SIGKILLed trainer ran forever."""
    from tests.support.processes import wait_for_exit

    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    trainer = subprocess.Popen(
        [sys.executable, str(script), method], cwd=root, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    workers: list[int] = []
    try:
        workers = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(workers) == 2, "the trainer did not start its loader"
        trainer.kill()
        trainer.wait(30)
        wait_for_exit(workers, 20.0, "the dead trainer's DataLoader workers")  # torch's own check: 5 s
    finally:
        trainer.kill()
        trainer.wait(30)
        trainer.stdout.close()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _ShutsDownWhenCollected:
    """A queue's user in a reference cycle whose finalizer sends a last message and closes the queue, as a
    ``DataLoader`` iterator held by an exception's traceback does."""

    def __init__(self, direct: DirectQueue) -> None:
        self.direct, self.cycle = direct, self

    def __del__(self) -> None:
        self.direct.put("last words")
        self.direct.close()


def _read_message(fd: int) -> object:
    (size,) = struct.unpack("!i", os.read(fd, 4))
    return ForkingPickler.loads(os.read(fd, size))


def test_a_queue_collected_in_a_cycle_stays_usable_for_the_cycles_other_finalizers(monkeypatch):
    """The collector finalizes a cycle's objects in no particular order; here the queue's pipe ends (made
    first) come first. A ``Connection``'s finalizer closed its descriptor without marking it closed, so the
    user's last message went to a closed number (EBADF, an exception ignored in its ``__del__``) and its
    close closed the numbers again."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    direct = loader_context("fork").Queue()
    spare = os.dup(direct._reader.fileno())  # the reading end of a worker, which lives on
    numbers = direct._reader.fileno(), direct._writer.fileno()
    try:
        _ShutsDownWhenCollected(direct)
        del direct
        gc.collect()
        assert [(hook.exc_type, str(hook.exc_value)) for hook in ignored] == []
        assert _read_message(spare) == "last words"
        for number in numbers:  # closed once the collection is over
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.fstat(number)
    finally:
        os.close(spare)


def test_a_pipe_end_dropped_outside_a_collection_closes_at_once():
    direct = loader_context("fork").Queue()
    numbers = direct._reader.fileno(), direct._writer.fileno()
    del direct  # no cycle: freed here, by its reference count
    for number in numbers:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(number)


def test_a_loader_collected_with_its_error_tells_its_workers_to_exit(monkeypatch):
    """The iterator held by the error's traceback is collected with its queues, in whatever order the
    collector takes them (Python 3.11's full collection lists younger generations after the oldest, so
    a queue's pipe ends can come before their older iterator, as they did in CI): its shutdown reaches
    the workers, which exit on its message instead of being terminated after a 5-s join."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        loader = _failing_loader(engine)
        iterator = iter(loader)
        workers = list(iterator._workers)
        try:
            next(iterator)
        except ValueError as error:
            caught = error  # its traceback holds the iterator
        assert "transform failed in the worker" in str(caught)
        del iterator, loader, caught
        gc.collect()
    assert [(hook.exc_type, str(hook.exc_value)) for hook in ignored] == []
    assert [worker.exitcode for worker in workers] == [0, 0]  # exited on the message, not terminated
