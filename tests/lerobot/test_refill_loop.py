"""``refill_until``: the loop ``simstream record`` (and its benchmark) keeps producers busy with."""

from __future__ import annotations

import threading

import pytest

from simstream import OnlineDataEngine
from simstream.cli.record import refill_until
from tests.support.engines import make_cfg, stop_quietly
from tests.support.sources import ScriptedSpec

pytestmark = pytest.mark.timeout(120)


def test_each_generation_is_requested_when_the_one_before_completes_not_at_the_next_look():
    """With looks a day apart the loop still runs generation after generation: it requests each one on
    the completion of the one before (a loop that requested once per look would wait a day)."""
    engine = OnlineDataEngine(make_cfg(refill_policy="manual", num_workers=2))
    looks, outcome = [], []
    with engine:

        def loop() -> None:
            done = lambda: engine.get_stats()["completed_generation"] >= 4  # noqa: E731
            try:
                refill_until(engine, done, lambda: looks.append(engine.get_stats()["completed_generation"]),
                             every_s=86_400.0)  # fmt: skip
                outcome.append("returned")
            except BaseException as error:  # the engine stopped under it (the test failed)
                outcome.append(error)

        thread = threading.Thread(target=loop)
        thread.start()
        thread.join(60)
        if thread.is_alive():
            stop_quietly(engine)  # ends the loop's wait with an error
            thread.join(30)
        assert outcome == ["returned"]
        # one look, at the start, after the first generation; generation 2, requested just before the
        # look, may have completed too (nothing else asks for one: the refill policy is manual)
        assert len(looks) == 1 and looks[0] in (1, 2)
        stats = engine.get_stats()
        assert stats["completed_generation"] >= 4
        assert stats["successful_episodes"] >= 4 * 4


@pytest.mark.parametrize(
    ("fault", "error", "message"),
    [
        ("raise", KeyError, "scripted failure in rollout"),
        # the producer's own TimeoutError is not a wait that ran out (the loop spun on it forever)
        ("timeout", TimeoutError, "simulator step timed out"),
    ],
)
def test_a_producer_failure_ends_the_loop_with_the_original_exception(fault, error, message):
    spec = ScriptedSpec(fault=fault, fault_after=3)
    engine = OnlineDataEngine(make_cfg(spec, refill_policy="manual"))
    engine.start()
    try:
        with pytest.raises(error, match=message):
            refill_until(engine, lambda: False, lambda: None, every_s=0.05)
    finally:
        stop_quietly(engine)


def test_what_the_look_raises_ends_the_loop():
    engine = OnlineDataEngine(make_cfg(refill_policy="manual"))

    def look() -> None:
        raise OSError("the disk is full")

    with engine, pytest.raises(OSError, match="the disk is full"):
        refill_until(engine, lambda: False, look)
