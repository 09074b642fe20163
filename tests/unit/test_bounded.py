"""``held``: a lock whose holder was killed ends the wait through the check, never a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from simstream._bounded import held

pytestmark = pytest.mark.timeout(60)


def _take_and_die(lock, taken) -> None:
    lock.acquire()
    taken.set()
    os.kill(os.getpid(), signal.SIGKILL)


class HolderDied(RuntimeError):
    pass


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_lock_left_held_by_a_killed_process_ends_the_wait_through_the_check(method):
    ctx = mp.get_context(method)
    lock, taken = ctx.Lock(), ctx.Event()
    holder = ctx.Process(target=_take_and_die, args=(lock, taken))
    holder.start()
    assert taken.wait(30)
    holder.join(30)
    assert holder.exitcode == -signal.SIGKILL
    checks = []

    def check() -> None:
        checks.append(None)
        if len(checks) == 3:
            raise HolderDied("the holder died")

    with pytest.raises(HolderDied), held(lock, check, slice_s=0.01):
        pytest.fail("the lock was never released")
    assert len(checks) == 3


def test_a_free_lock_is_taken_at_once_and_released_after(method="fork"):
    lock = mp.get_context(method).Lock()
    with held(lock, lambda: pytest.fail("must not wait")):
        assert not lock.acquire(False)
    assert lock.acquire(False)
    lock.release()


def test_the_lock_is_released_when_the_body_raises():
    lock = mp.get_context("fork").Lock()
    with pytest.raises(KeyError), held(lock, None):
        raise KeyError("body")
    assert lock.acquire(False)


@pytest.mark.parametrize("make_lock", ["Lock", "RLock", "Condition"])
def test_the_with_block_runs_on_the_c_level_semaphore(make_lock):
    """Python-level enter/exit code would let Ctrl-C land between taking the lock and the with block
    (or between the block and releasing it), leaving the lock taken for every producer."""
    lock = getattr(mp.get_context("fork"), make_lock)()
    target = held(lock, lambda: None)
    assert type(target).__module__ == "_multiprocessing" and type(target).__name__ == "SemLock"
    for name in ("__enter__", "__exit__"):  # C methods: no Python frame for Ctrl-C to land in
        assert type(vars(type(target))[name]).__name__ == "method_descriptor"
    with target:
        assert target._is_mine()
    assert not target._is_mine()


class _Interrupting:
    """A semaphore whose acquire succeeds and then raises, as a Ctrl-C does right after the call."""

    def __init__(self, semlock) -> None:
        self.semlock = semlock

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        assert self.semlock.acquire(block, timeout)
        raise KeyboardInterrupt

    def release(self) -> None:
        self.semlock.release()

    def _is_mine(self) -> bool:
        return self.semlock._is_mine()


def test_an_interrupt_right_after_the_probe_took_the_lock_gives_it_back():
    lock = mp.get_context("fork").Lock()

    class Wrapped:
        _semlock = _Interrupting(lock._semlock)

    with pytest.raises(KeyboardInterrupt):
        held(Wrapped(), lambda: None)
    assert lock.acquire(False), "the lock was left taken"
    lock.release()
