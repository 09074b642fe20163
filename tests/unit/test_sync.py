"""The cross-process primitives: no holder's or sleeper's death or stop wedges anyone else."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from simstream._sync import Doorbell, ProcessSlots, SharedFlag, SharedLock, _rebuild_lock, process_is_stopped
from simstream.engine.progress import ProducerProgress
from simstream.workers.channel import ErrorChannel

pytestmark = pytest.mark.timeout(120)

_BOUND_S = 30.0


def _sleep_on(bell: Doorbell, asleep) -> None:
    asleep.set()
    bell.wait(600.0)


@pytest.mark.parametrize("fate", [signal.SIGKILL, signal.SIGSTOP])
def test_ringing_never_waits_for_a_sleeper_that_died_or_stopped(fate):
    ctx = mp.get_context("fork")
    bell, asleep = Doorbell(ctx), ctx.Event()
    sleeper = ctx.Process(target=_sleep_on, args=(bell, asleep))
    sleeper.start()
    assert asleep.wait(_BOUND_S)
    os.kill(sleeper.pid, fate)
    try:
        done = threading.Event()
        rings = threading.Thread(target=lambda: ([bell.ring() for _ in range(1000)], done.set()), daemon=True)
        rings.start()
        assert done.wait(_BOUND_S), "ring() waited for the sleeper"
    finally:
        os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.join(_BOUND_S)


def _ring_after(bell: Doorbell, go) -> None:
    go.wait(60)
    bell.ring()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_ring_from_another_process_wakes_the_sleeper(method):
    ctx = mp.get_context(method)
    bell, go = Doorbell(ctx), ctx.Event()
    ringer = ctx.Process(target=_ring_after, args=(bell, go))
    ringer.start()
    go.set()
    assert bell.wait(600.0)  # far past the test's own bound: only the ring can end it in time
    ringer.join(_BOUND_S)
    assert not bell.wait(0.0), "rings are consumed by the wake-up"


def test_a_flag_is_shared_with_children():
    ctx = mp.get_context("fork")
    flag = SharedFlag(ctx)
    child = ctx.Process(target=flag.set)
    child.start()
    child.join(_BOUND_S)
    assert flag.is_set()


def _take_and_die(lock: SharedLock, taken) -> None:
    lock.acquire(None)
    taken.set()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_lock_whose_holder_was_killed_is_free_at_once(method):
    ctx = mp.get_context(method)
    lock, taken = SharedLock(), ctx.Event()
    holder = ctx.Process(target=_take_and_die, args=(lock, taken))
    holder.start()
    assert taken.wait(_BOUND_S)
    holder.join(_BOUND_S)
    assert holder.exitcode == -signal.SIGKILL

    def must_not_wait() -> None:
        raise AssertionError("the dead holder's lock was not released by the kernel")

    with lock.held(must_not_wait, slice_s=5.0):
        assert lock.is_held_here()
    assert not lock.is_held_here()


def _take_and_stop(lock: SharedLock, taken) -> None:
    lock.acquire(None)
    taken.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    lock.release()


class _GaveUp(Exception):
    pass


def _wait_until_stopped(pid: int) -> None:
    deadline = time.monotonic() + _BOUND_S
    while True:
        if process_is_stopped(pid):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        threading.Event().wait(0.001)


def test_a_wait_for_a_stopped_holder_is_bounded_by_its_check():
    ctx = mp.get_context("fork")
    lock, taken = SharedLock(), ctx.Event()
    holder = ctx.Process(target=_take_and_stop, args=(lock, taken))
    holder.start()
    try:
        assert taken.wait(_BOUND_S)
        _wait_until_stopped(holder.pid)  # else the SIGCONT below could come first and be lost
        checks = []

        def check() -> None:
            checks.append(None)
            if len(checks) == 3:
                raise _GaveUp

        with pytest.raises(_GaveUp), lock.held(check, slice_s=0.01):
            pytest.fail("the stopped holder's lock was taken")
        assert len(checks) == 3 and not lock.is_held_here()
        os.kill(holder.pid, signal.SIGCONT)
        holder.join(_BOUND_S)
        assert holder.exitcode == 0
        with lock.held(lambda: pytest.fail("the continued holder did not release it")):
            pass
    finally:
        if holder.exitcode is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(_BOUND_S)


def test_threads_of_one_process_exclude_each_other():
    lock, inside, overlaps = SharedLock(), [], []

    def work() -> None:
        for _ in range(300):
            with lock.held(None):
                inside.append(None)
                if len(inside) > 1:
                    overlaps.append(None)
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_BOUND_S)
    assert not overlaps


def test_a_lock_left_taken_by_an_interrupt_in_this_thread_is_taken_over():
    lock = SharedLock()
    lock.acquire(None)  # as if Ctrl-C landed between taking the lock and the with block
    with lock.held(lambda: pytest.fail("waited on itself")):
        assert lock.is_held_here()
    assert not lock.is_held_here()


def test_release_of_a_lock_not_held_here_is_an_error():
    with pytest.raises(RuntimeError, match="does not hold"):
        SharedLock().release()


def lock_file_descriptors() -> int:
    """Descriptors of this process open on simstream lock files (memfds named ``simstream-lock``)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:simstream-lock")
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return count


class _Duplicate:
    """What a child unpickles in place of ``reduction.DupFd``: a descriptor of the same file."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)

    def detach(self) -> int:
        return self.fd


def test_the_last_collected_user_of_a_lock_file_closes_its_descriptor():
    gc.collect()
    before = lock_file_descriptors()
    locks, slots = [SharedLock() for _ in range(5)], ProcessSlots(4)
    assert slots.mine() == 0
    assert lock_file_descriptors() == before + 6
    copy = _rebuild_lock(_Duplicate(locks[0]._file.fd), 0)  # not held here: the duplicate is closed at once
    assert copy._file is locks[0]._file
    assert lock_file_descriptors() == before + 6
    del locks[1:], slots
    gc.collect()
    assert lock_file_descriptors() == before + 1
    del locks
    gc.collect()
    assert lock_file_descriptors() == before + 1, "a copy still uses the file"
    del copy
    gc.collect()
    assert lock_file_descriptors() == before


def _checks_then_give_up(limit: int):
    tries = []

    def check() -> None:
        tries.append(None)
        if len(tries) >= limit:
            raise _GaveUp

    return check


def _take_twice(lock: SharedLock, go, results) -> None:
    """Report whether the lock is free now, then again once told to look (each try bounded)."""
    for gate in (None, go):
        if gate is not None:
            gate.wait(_BOUND_S)
        give_up = _checks_then_give_up(3 if gate is None else int(_BOUND_S / 0.01))
        try:
            lock.acquire(give_up, slice_s=0.01)
        except _GaveUp:
            results.send("busy")
        else:
            lock.release()
            results.send("taken")


def test_a_held_lock_keeps_its_duplicate_and_is_released_when_its_last_user_goes():
    ctx = mp.get_context("fork")
    gc.collect()
    before = lock_file_descriptors()
    lock = SharedLock()
    lock.acquire(None)
    copy = _rebuild_lock(_Duplicate(lock._file.fd), 0)  # closing it would drop the held record lock: kept
    assert lock_file_descriptors() == before + 2
    go = ctx.Event()
    received, results = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_take_twice, args=(copy, go, results))
    child.start()
    try:
        assert received.poll(_BOUND_S) and received.recv() == "busy"
        del lock
        gc.collect()
        assert lock_file_descriptors() == before + 2, "a copy still uses the file: nothing closed"
        del copy
        gc.collect()
        assert lock_file_descriptors() == before  # closing released the record lock it held
        go.set()
        assert received.poll(_BOUND_S) and received.recv() == "taken"
    finally:
        child.join(_BOUND_S)
    assert child.exitcode == 0


def _claim(slots: ProcessSlots, results, release, die: bool) -> None:
    results.send(slots.mine())  # written before send() returns: a SIGKILL right after loses nothing
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    release.wait(60)  # hold the slot until the parent has seen every claim


def test_live_processes_hold_distinct_slots_and_a_dead_ones_is_reused():
    ctx = mp.get_context("fork")
    slots, release = ProcessSlots(3), ctx.Event()
    claims, results = ctx.Pipe(duplex=False)

    def claimed():
        assert claims.poll(_BOUND_S), "no claim reported"
        return claims.recv()

    assert slots.mine() == 0 and slots.mine() == 0  # claimed once, kept
    dead = ctx.Process(target=_claim, args=(slots, results, release, True))
    dead.start()
    assert claimed() == 1
    dead.join(_BOUND_S)
    live = ctx.Process(target=_claim, args=(slots, results, release, False))
    live.start()
    assert claimed() == 1, "the dead process's slot was not free again"
    full = ctx.Process(target=_claim, args=(slots, results, release, False))
    full.start()
    assert claimed() == 2
    last = ctx.Process(target=_claim, args=(slots, results, release, False))
    last.start()
    assert claimed() is None, "every slot is held: none to give"
    release.set()
    for process in (live, full, last):
        process.join(_BOUND_S)
        assert process.exitcode == 0


def _count(progress: ProducerProgress, times: int) -> None:
    for _ in range(times):
        progress.record_sampled(1, None)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_per_process_counters_sum_exactly(method):
    ctx = mp.get_context(method)
    progress = ProducerProgress(1, ctx)
    children = [ctx.Process(target=_count, args=(progress, 500)) for _ in range(3)]
    for child in children:
        child.start()
    threads = [threading.Thread(target=_count, args=(progress, 500)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for worker in [*children, *threads]:
        worker.join(_BOUND_S)
    assert progress.sampled_total() == 2500
    assert progress.snapshot()["sampled_chunks"] == 2500


def _hold_the_overflow_lock_stopped(progress: ProducerProgress, ready, leave) -> None:
    assert progress._consumer_slots.mine() == 0  # the only row of its own: the parent shares the overflow
    progress._overflow_lock.acquire(None)
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    progress._overflow_lock.release()
    leave.wait(_BOUND_S)


def test_a_count_past_the_own_rows_does_not_wait_for_a_stopped_holder_of_their_lock():
    """Sampling processes past the rows of their own share one row under a lock: a holder stopped (SIGSTOP,
    a debugger) kept every other such process's sample_batch waiting until it was continued. The count
    now waits in the process and goes in with the next one."""
    ctx = mp.get_context("fork")
    progress = ProducerProgress(1, ctx)
    progress._consumer_slots = ProcessSlots(1)  # the child takes it; this process is past the rows
    ready, leave = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_the_overflow_lock_stopped, args=(progress, ready, leave))
    holder.start()
    try:
        assert ready.wait(_BOUND_S)
        deadline = time.monotonic() + _BOUND_S
        while not process_is_stopped(holder.pid) and time.monotonic() < deadline:
            threading.Event().wait(0.001)  # a bounded poll: nothing tells when a SIGSTOP took effect
        assert process_is_stopped(holder.pid)
        counting = threading.Thread(target=progress.record_sampled, args=(3, None))
        counting.start()
        counting.join(_BOUND_S)
        assert not counting.is_alive(), "record_sampled waited for the stopped holder"
        assert progress.sampled_total() == 0
        os.kill(holder.pid, signal.SIGCONT)
        deadline = time.monotonic() + _BOUND_S
        while progress._overflow_lock.holder_pid() is not None and time.monotonic() < deadline:
            threading.Event().wait(0.001)
        progress.record_sampled(2, None)
        assert progress.sampled_total() == 5, "the count that waited went in with the next"
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        leave.set()
        holder.join(_BOUND_S)
    assert holder.exitcode == 0


def test_a_refill_is_requested_once_per_threshold_and_only_when_none_is_outstanding():
    progress = ProducerProgress(1, mp.get_context("fork"))
    progress.record_sampled(5, None)
    progress.request_after_samples(8, None)
    assert progress.requested_generation == 0
    progress.record_sampled(3, None)
    progress.request_after_samples(8, None)
    assert progress.requested_generation == 1
    progress.record_sampled(20, None)
    progress.request_after_samples(8, None)
    assert progress.requested_generation == 1, "one request outstanding: no second one"
    progress.set_worker_completed(0, 1)
    progress.request_after_samples(8, None)
    assert progress.requested_generation == 2, "the chunks sampled meanwhile count toward the next"


def test_a_close_failure_after_another_failure_becomes_a_note_in_every_process():
    ctx = mp.get_context("fork")
    channel = ErrorChannel(ctx)
    first = KeyError("the rollout failed")
    assert channel.publish(first, "producer-0")
    channel.publish_durability_failure(OSError("flush failed"), "producer-1")
    assert channel.error() is first
    assert first.__notes__ == ["producer-1: source close() also failed: OSError: flush failed"]
    reader = ErrorChannel.__new__(ErrorChannel)
    reader.__setstate__(channel.__getstate__())
    assert reader.error().__notes__ == first.__notes__  # never raised: no traceback to note


def test_a_close_failure_alone_is_the_published_failure():
    channel = ErrorChannel(mp.get_context("fork"))
    error = OSError("flush failed")
    channel.publish_durability_failure(error, "producer-0")
    assert channel.error() is error and not getattr(error, "__notes__", [])
