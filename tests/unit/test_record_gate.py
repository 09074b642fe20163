"""The record gate's claim rule, its modes, and its state shared with the processes it is pickled into."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from simstream.buffer.gate import RecordGate

_BOUND_S = 30.0


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_off_never_waits_and_skip_counts_what_it_overwrites():
    gate = RecordGate(3)
    published = _ids(4, -1, 7)
    gate.before_claim(0, 3, published)  # off: no recorder, nothing to wait for
    assert gate.skipped.tolist() == [0, 0, 0]
    gate.attach("skip")
    gate.mark_recorded(0, 4)
    gate.before_claim(0, 3, published)  # row 2 holds episode 7, not recorded: counted, not waited for
    assert gate.skipped.tolist() == [0, 0, 1] and gate.total_skipped() == 1


def test_skip_mode_settles_each_episode_once_recorded_or_skipped():
    """A copy completes while a claim overtakes it: whichever settles first wins, the other backs off."""
    gate = RecordGate(2)
    gate.attach("skip")
    published = _ids(4, 6)
    assert gate.settle(0, 4, lambda: True, None)  # copied and settled first: the claim counts nothing
    gate.before_claim(0, 1, published)
    assert gate.skipped.tolist() == [0, 0]
    gate.before_claim(1, 2, published)  # the claim settles first: counted, and the copy is discarded
    assert gate.skipped.tolist() == [0, 1] and gate.recorded.tolist() == [4, 6]
    assert not gate.settle(1, 6, lambda: True, None)
    assert gate.total_skipped() == 1
    assert not gate.settle(1, 8, lambda: False, None)  # the row changed while it was copied
    assert gate.recorded.tolist() == [4, 6]


def test_settling_outside_skip_mode_follows_the_row_only():
    gate = RecordGate(1)
    gate.attach("wait")
    assert not gate.settle(0, 3, lambda: False, None) and gate.recorded.tolist() == [-1]
    assert gate.settle(0, 3, lambda: True, None) and gate.recorded.tolist() == [3]


def _claim_while_settling(gate: RecordGate, ready, done) -> None:
    ready.set()
    gate.before_claim(0, 1, _ids(5))
    done.set()


def test_a_claim_in_another_process_waits_for_a_copy_being_settled():
    """The lock is shared with the producers: a claim that arrives while the recorder settles a copy of
    the row counts nothing once the copy is kept."""
    ctx = mp.get_context("spawn")
    gate, ready, done = RecordGate(1), ctx.Event(), ctx.Event()
    gate.attach("skip")
    child = ctx.Process(target=_claim_while_settling, args=(gate, ready, done))

    def unchanged() -> bool:  # runs under the lock: the producer claims the row right now
        child.start()
        assert ready.wait(_BOUND_S)
        assert not done.wait(1.0), "the claim did not wait for the settling copy"
        return True

    try:
        assert gate.settle(0, 5, unchanged, None)
        assert done.wait(_BOUND_S)
    finally:
        child.join(_BOUND_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and gate.skipped.tolist() == [0]


def test_wait_mode_runs_the_check_until_the_rows_are_recorded():
    gate = RecordGate(2)
    gate.attach("wait")
    published, checks = _ids(3, 5), []

    def check() -> None:  # the recorder copies row 1 while the producer waits
        checks.append(1)
        if len(checks) == 2:
            gate.mark_recorded(0, 3)
            gate.mark_recorded(1, 5)

    gate.before_claim(0, 2, published, check)
    assert len(checks) == 2 and gate.skipped.tolist() == [0, 0]
    # the claim slept at least its first 1-ms slice; the time goes to the row its claim starts at
    waited = gate.waited_ns.tolist()
    assert waited[0] >= 1_000_000 and waited[1] == 0
    assert gate.total_waited_s() == pytest.approx(waited[0] / 1e9)

    published = _ids(6, 5)

    def give_up() -> None:
        raise TimeoutError("closing")

    with pytest.raises(TimeoutError, match="closing"):
        gate.before_claim(0, 1, published, give_up)
    assert gate.waited_ns[0] > waited[0]  # an abandoned wait counts too (it rang, then the check raised)
    waited = gate.waited_ns.tolist()
    gate.before_claim(1, 2, published, give_up)  # row 1 is recorded: no wait, no check
    assert gate.waited_ns.tolist() == waited


def _claim_in_child(gate: RecordGate, go, done) -> None:
    """A producer's side: one claim of row 0 per ``go``, episodes 9, 10 and 11 published there in turn."""
    for episode in (9, 10, 11):
        if not go.wait(60):
            return
        go.clear()
        gate.before_claim(0, 1, _ids(episode))
        done.set()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_copy_in_another_process_follows_the_shared_mode(method):
    """Pickled into a producer process, the gate reads the owner's mode: attach and detach reach its claims,
    and a claim that must wait for the recorder wakes it, while claims that need not wait wake nothing."""
    ctx = mp.get_context(method)
    gate, go, done = RecordGate(1), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_claim_in_child, args=(gate, go, done))
    child.start()
    try:

        def claim() -> None:
            done.clear()
            go.set()

        claim()  # off: nothing counted, nothing waited for, no recorder to wake
        assert done.wait(_BOUND_S)
        assert gate.skipped.tolist() == [0]
        assert not gate.wait_for_demand(0.0)
        gate.attach("skip")
        claim()
        assert done.wait(_BOUND_S)
        assert gate.skipped.tolist() == [1]  # counted through the shared tensor; the producer never waits
        assert gate.waited_ns.tolist() == [0]
        assert not gate.wait_for_demand(0.0)
        gate.attach("wait")
        claim()
        assert gate.wait_for_demand(600.0)  # far past the test's bound: only the waiting claim's ring ends it
        assert not done.is_set(), "the claim returned before its row was recorded"
        gate.mark_recorded(0, 11)  # the recorder copied the row: the claim proceeds
        assert done.wait(_BOUND_S)
        assert gate.skipped.tolist() == [1]
        assert gate.waited_ns[0] >= 1_000_000  # the producer's wait, through the shared tensor
        assert not gate.wait_for_demand(0.0), "one ring per wait, not one per slice"
    finally:
        child.join(_BOUND_S)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_wake_ends_the_recorders_wait():
    gate = RecordGate(1)
    gate.wake()
    assert gate.wait_for_demand(600.0)
    assert not gate.wait_for_demand(0.0), "rings are consumed by the wake-up"


def test_attach_rejects_an_unknown_mode():
    gate = RecordGate(1)
    with pytest.raises(ValueError, match="RecordGate mode must be 'wait' or 'skip', got 'off'"):
        gate.attach("off")
