"""The record gate's claim rule, its modes, and its state shared with the processes it is pickled into."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from simstream.buffer.gate import RecordGate


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

    published = _ids(6, 5)

    def give_up() -> None:
        raise TimeoutError("closing")

    with pytest.raises(TimeoutError, match="closing"):
        gate.before_claim(0, 1, published, give_up)
    gate.before_claim(1, 2, published, give_up)  # row 1 is recorded: no wait, no check


def test_a_copy_in_another_process_follows_the_shared_mode():
    """Pickled as into a producer, the gate reads the owner's mode: attach and detach reach its claims."""
    gate = RecordGate(1)
    copy = pickle.loads(ForkingPickler.dumps(gate))  # shares the tensors' memory, as a child process does
    published = _ids(9)
    copy.before_claim(0, 1, published)  # off
    gate.attach("skip")
    copy.before_claim(0, 1, published)
    assert gate.skipped.tolist() == [1]  # counted through the shared tensor
    gate.detach()
    copy.before_claim(0, 1, published)
    assert gate.skipped.tolist() == [1]
    with pytest.raises(ValueError, match="RecordGate mode must be 'wait' or 'skip', got 'off'"):
        gate.attach("off")
