"""DataLoader workers' reusable output slots: batches by reference, never rewritten while referenced."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.multiprocessing.reductions import shared_cache
from torch.utils.data import DataLoader

from simstream import OnlineDataEngine
from simstream.data import OnlineDataset
from simstream.data import worker_slots as slots_module
from simstream.data.worker_slots import WorkerSlots
from simstream.sampling.gather import BatchLayout
from tests.support.engines import make_cfg
from tests.support.sources import ScriptedSpec, assert_whole_chunks

pytestmark = pytest.mark.timeout(120)


def _arena(batch) -> int:
    """Address of the memory a batch's keys live in (one arena per batch)."""
    return batch["obs"].untyped_storage().data_ptr()


def _loader(engine, *, workers: int = 2, context: str = "fork", worker_slots: int = 6, **dataset_kwargs):
    dataset = OnlineDataset(
        engine, chunk_size=4, batch_size=8, seed=5, worker_slots=worker_slots, **dataset_kwargs
    )
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        collate_fn=OnlineDataset.passthrough_collate_fn,
        timeout=60,
    )


@contextmanager
def _iterating(loader: DataLoader):
    """An iterator over ``loader`` whose workers are shut down on every exit path (failures included)."""
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        getattr(iterator, "_shutdown_workers", lambda: None)()


def _refilling_engine() -> OnlineDataEngine:
    """An engine whose producers keep rewriting rows while workers sample (content keeps changing)."""
    return OnlineDataEngine(make_cfg(ScriptedSpec(lengths=(20, 9)), buffer_size=6, refill_threshold=1))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_batches_are_whole_chunks_in_reused_slots(context):
    with _refilling_engine() as engine:
        arenas = []
        with _iterating(_loader(engine, context=context)) as iterator:
            for _ in range(40):
                batch = next(iterator)
                assert_whole_chunks(batch)
                arenas.append(_arena(batch))
                del batch
    # 40 batches from 2 workers came from at most 2 x 6 slots, each written again and again
    assert len(set(arenas)) <= 12
    assert max(arenas.count(address) for address in set(arenas)) >= 3


def _released(arena: int) -> bool | None:
    """Whether this (trainer) process has handed the slot at ``arena`` back to its worker."""
    for pool in slots_module._RECEIVED.values():
        for index, slot in pool.slots.items():
            if slot.anchor.untyped_storage().data_ptr() == arena:
                return slot.trips == 0 and int(pool.flags[1, index]) == int(pool.flags[0, index])
    return None


def _hold(batch, kind: str):
    if kind == "batch":
        return batch
    if kind == "leaf":
        return batch["obs"]
    if kind == "view":
        return batch["obs"][:, 1:, :2]
    if kind == "numpy":
        return batch["actions"].numpy()
    if kind == "storage":
        return batch["obs"].untyped_storage()
    raise AssertionError(kind)


def _held_values(held) -> np.ndarray:
    if isinstance(held, torch.UntypedStorage):
        return np.frombuffer(bytes(held), dtype=np.uint8).copy()
    if isinstance(held, np.ndarray):
        return held.copy()
    if isinstance(held, torch.Tensor):
        return held.clone().numpy()
    return held["obs"].clone().numpy()


@pytest.mark.parametrize("kind", ["batch", "leaf", "view", "numpy", "storage"])
def test_a_referenced_batch_is_never_rewritten_and_is_released_once_dropped(kind):
    with _refilling_engine() as engine, _iterating(_loader(engine)) as iterator:
        for _ in range(4):
            next(iterator)
        batch = next(iterator)
        held_arena = _arena(batch)
        held = _hold(batch, kind)
        before = _held_values(held)
        del batch
        later = []
        for _ in range(30):
            later.append(_arena(next(iterator)))
        # while anything of it is referenced, its slot is never written again
        assert held_arena not in later
        assert np.array_equal(_held_values(held), before)
        assert _released(held_arena) is False
        del held
        # arrivals from its worker run the release pass; once FREE the worker may write the slot again at
        # once (and send it back), so either outcome shows the release
        back = False
        for _ in range(40):
            back = _arena(next(iterator)) == held_arena or _released(held_arena) is True
            if back:
                break
        assert back, "the dropped batch's slot was never released"
        assert engine.get_stats()["requested_generation"] >= 2  # rows were rewritten meanwhile


def test_batches_kept_beyond_the_slots_fall_back_to_fresh_memory():
    with _refilling_engine() as engine:
        with _iterating(_loader(engine, worker_slots=1)) as iterator:
            kept = [next(iterator) for _ in range(10)]
            copies = [batch.clone() for batch in kept]
            for _ in range(10):
                next(iterator)
        assert len({_arena(batch) for batch in kept}) == 10
        for batch, copy in zip(kept, copies):
            assert_whole_chunks(batch)
            assert (batch == copy).all()


@pytest.mark.parametrize("worker_slots", [0, 6])
def test_transforms_in_workers_travel_with_or_without_slot_views(worker_slots):
    with _refilling_engine() as engine:
        select = lambda td: td.select("obs", "valid")  # noqa: E731  (views of the slot's keys)
        clone = lambda td: td.clone()  # noqa: E731  (new tensors: the slot itself never travels)
        with (
            _iterating(_loader(engine, worker_slots=worker_slots, transform=select)) as views,
            _iterating(_loader(engine, worker_slots=worker_slots, transform=clone)) as copies,
        ):
            for _ in range(12):
                selected = next(views)
                assert set(selected.keys()) == {"obs", "valid"}
                assert bool(selected["valid"].all())
                assert bool((selected["obs"][:, 1:, 1] - selected["obs"][:, :-1, 1] == 1).all())
                assert_whole_chunks(next(copies))


def _annotate(td: TensorDict) -> TensorDict:
    """What a transform may add besides tensors: a non-tensor entry, an empty sub-dict, dimension names."""
    td.set_non_tensor("instruction", "pick the cube")
    td["meta"] = TensorDict({}, batch_size=td.batch_size)
    td.names = ["batch", "time"]
    return td


def _assert_annotated(batch: TensorDict, batch_size: tuple[int, int]) -> None:
    assert batch.batch_size == torch.Size(batch_size)
    assert batch.get_non_tensor("instruction") == "pick the cube"
    assert "meta" in batch and batch["meta"].is_empty()
    assert batch.names == ["batch", "time"]
    assert_whole_chunks(batch)


@pytest.mark.parametrize("worker_slots", [0, 6])
def test_what_a_transform_adds_besides_tensors_reaches_the_trainer(worker_slots):
    """A batch travelled as a bare slot reference when its tensors matched the slot's, and the trainer
    rebuilt it from the slot's layout alone: non-tensor entries, empty sub-dicts and names were lost."""
    with (
        _refilling_engine() as engine,
        _iterating(_loader(engine, worker_slots=worker_slots, transform=_annotate)) as iterator,
    ):
        for _ in range(6):
            _assert_annotated(next(iterator), (8, 4))


@pytest.mark.parametrize("workers", [0, 2])
def test_item_mode_collate_keeps_what_a_transform_adds_besides_tensors(workers):
    """``stack(out=)`` fills only the keys of ``out``: the collate stacked the items without their
    non-tensor entries, in the trainer and in workers alike."""
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=4, seed=2, transform=_annotate_item)
        context = {"multiprocessing_context": "fork"} if workers else {}
        loader = dataset.loader(batch_size=3, num_workers=workers, **context)
        with _iterating(loader) as iterator:
            for _ in range(4):
                batch = next(iterator)
                assert batch[2, 3].get_non_tensor("instruction") == "pick the cube"  # stacked per frame
                assert "meta" in batch and batch.batch_size == torch.Size([3, 4])
                assert_whole_chunks(batch)


def _on_cpu_and_locked(td: TensorDict) -> TensorDict:
    return td.to("cpu").lock_()


def test_a_batch_s_device_and_lock_reach_the_trainer():
    with _refilling_engine() as engine, _iterating(_loader(engine, transform=_on_cpu_and_locked)) as iterator:
        for _ in range(4):
            batch = next(iterator)
            assert batch.device == torch.device("cpu") and batch.is_locked
            assert_whole_chunks(batch)


def test_collating_items_that_differ_in_keys_fails_as_torch_stack_does():
    """Only the first item was looked at: a later item's non-tensor entry was dropped without a word."""
    first = TensorDict({"obs": torch.zeros(4, 2)}, [4])
    second = first.clone()
    second.set_non_tensor("instruction", "pick the cube")
    with pytest.raises(RuntimeError, match="The sets of keys in the tensordicts to stack are exclusive"):
        OnlineDataset.collate_fn([first, second])
    assert OnlineDataset.collate_fn([first, first.clone()]).batch_size == torch.Size([2, 4])


def _annotate_item(td: TensorDict) -> TensorDict:
    td.set_non_tensor("instruction", "pick the cube")
    td["meta"] = TensorDict({}, batch_size=td.batch_size)
    return td


def test_without_slots_every_batch_is_fresh_memory():
    with OnlineDataEngine(make_cfg(refill_policy="manual")) as engine:
        with _iterating(_loader(engine, worker_slots=0)) as iterator:
            batches = [next(iterator) for _ in range(6)]
        assert len({_arena(batch) for batch in batches}) == 6


def test_item_mode_collates_into_slots():
    with _refilling_engine() as engine:
        dataset = OnlineDataset(engine, chunk_size=4, seed=2)
        loader = DataLoader(
            dataset, batch_size=6, num_workers=2, collate_fn=OnlineDataset.collate_fn, timeout=60
        )
        arenas = []
        with _iterating(loader) as iterator:
            for _ in range(24):
                batch = next(iterator)
                assert batch.batch_size == torch.Size([6, 4])
                assert_whole_chunks(batch)
                arenas.append(_arena(batch))
                del batch
        assert len(set(arenas)) <= 12


# -- the release protocol, step by step (worker and trainer sides in this process) --------------------
def _send(slots: WorkerSlots, batch):
    """What a DataLoader worker's queue does: pickle (marking the slot HANDED); then unpickle here."""
    reduced = slots.reduce_batch(batch)
    assert reduced is not None
    rebuild, arguments = reduced
    message = ForkingPickler.dumps(arguments)
    shared_cache.clear()  # as in another process: map the slot's memory anew, not this process's storage
    return rebuild(*pickle.loads(message))


def _pointer(batch) -> int:
    return batch["obs"].untyped_storage().data_ptr()


def _small_layout() -> BatchLayout:
    """Batches of 4 items with one key, ``obs`` float32[3]."""
    return BatchLayout.of(TensorDict({"obs": torch.zeros(2, 3)}, batch_size=[2]), (4,))


def test_release_protocol_frees_a_slot_only_after_the_trainer_drops_it():
    layout = _small_layout()
    slots = WorkerSlots(max_slots=3)
    first = slots.acquire(layout)
    first_arena = _pointer(first)
    first["obs"].fill_(1.0)
    received_first = _send(slots, first)
    del first
    second = slots.acquire(layout)  # the first slot is with the trainer: another one
    assert _pointer(second) != first_arena
    second["obs"].fill_(2.0)
    received_second = _send(slots, second)
    slot_arenas = {first_arena, _pointer(second)}
    del second
    third = slots.acquire(layout)
    third["obs"].fill_(3.0)
    slot_arenas.add(_pointer(third))
    assert len(slot_arenas) == 3
    # every slot is referenced (two by the trainer, one by the worker itself): fresh memory instead
    assert _pointer(slots.acquire(layout)) not in slot_arenas and slots.fallbacks == 1
    # the trainer drops the first batch, but nothing has arrived since: its slot is not free yet
    del received_first
    assert _pointer(slots.acquire(layout)) not in slot_arenas and slots.fallbacks == 2
    # the next arrival frees every slot the trainer no longer references
    received_third = _send(slots, third)
    del third
    assert _pointer(slots.acquire(layout)) == first_arena and slots.fallbacks == 2
    assert received_second["obs"].tolist() == [[2.0] * 3] * 4
    assert received_third["obs"].tolist() == [[3.0] * 3] * 4


def test_an_arrival_from_any_worker_frees_every_worker_s_dropped_slots():
    layout = _small_layout()
    worker_a, worker_b = WorkerSlots(max_slots=2), WorkerSlots(max_slots=2)
    batch = worker_a.acquire(layout)
    arena_a = _pointer(batch)
    received_a = _send(worker_a, batch)
    del batch, received_a  # the trainer is done with worker A's batch
    batch = worker_b.acquire(layout)
    received_b = _send(worker_b, batch)  # a batch of worker B arrives
    del batch
    # worker A writes its next batch into the slot it wrote last, not into a second, colder one
    assert _pointer(worker_a.acquire(layout)) == arena_a and worker_a.fallbacks == 0
    assert worker_a._slots[1] is None
    del received_b


def test_a_slot_sent_twice_is_free_only_once_the_trainer_dropped_both_trips():
    """A transform may send a slot again (with the previous batch) while its first trip is still held."""
    layout = _small_layout()
    slots = WorkerSlots(max_slots=3)
    batch = slots.acquire(layout)
    arena = _pointer(batch)
    batch["obs"].fill_(1.0)
    first_trip = _send(slots, batch)
    second_trip = _send(slots, batch)  # the same slot, again
    del batch
    del first_trip  # the trainer drops one trip and holds the other
    other = slots.acquire(layout)
    other_arena = _pointer(other)
    assert other_arena != arena
    received_other = _send(slots, other)  # an arrival: the trainer releases what it no longer holds
    del other
    assert _pointer(slots.acquire(layout)) != arena, "the second trip is still held by the trainer"
    assert second_trip["obs"].tolist() == [[1.0] * 3] * 4
    del second_trip
    del received_other
    third = slots.acquire(layout)  # nothing arrived since: the trainer has not returned the slot yet
    received_third = _send(slots, third)  # this arrival returns both trips
    del third
    reused = [slots.acquire(layout), slots.acquire(layout)]
    assert {_pointer(batch) for batch in reused} == {arena, other_arena} and slots.fallbacks == 0
    del received_third


def test_the_trainer_keeps_the_slot_tables_of_every_live_worker():
    layout = _small_layout()
    workers = [WorkerSlots(max_slots=1) for _ in range(80)]  # e.g. several persistent loaders
    for slots in workers:
        batch = slots.acquire(layout)
        del batch
        _send(slots, slots.acquire(layout))
    batch = workers[0].acquire(layout)  # a reference now: its table must still be known here
    batch["obs"].fill_(4.0)
    assert _send(workers[0], batch)["obs"].tolist() == [[4.0] * 3] * 4


def test_a_collected_iterator_lets_go_of_its_workers_slots():
    """The trainer maps every worker's slot arena while the worker may send batches; once a loader's
    iterator is gone (its workers shut down), nothing of them stays mapped in the trainer."""
    import gc

    with _refilling_engine() as engine:
        loader = OnlineDataset(engine, chunk_size=4, batch_size=8, seed=5).loader(num_workers=2, timeout=60)
        iterator = iter(loader)
        batch = None
        for _ in range(6):
            batch = next(iterator)
        pids = {worker.pid for worker in iterator._workers}
        assert pids <= {pool.pid for pool in slots_module._RECEIVED.values()}
        kept = batch["obs"].clone()
        del iterator
        gc.collect()
        assert not pids & {pool.pid for pool in slots_module._RECEIVED.values()}
        assert torch.equal(batch["obs"], kept)  # a batch still held keeps its own memory


class _WithPrevious:
    """A transform that also returns the batch before: its slot travels a second time."""

    def __init__(self) -> None:
        self.previous = None

    def __call__(self, batch):
        pair = {"now": batch, "before": batch if self.previous is None else self.previous}
        self.previous = batch
        return pair


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_batch_sent_again_by_a_transform_is_never_rewritten_while_held(context):
    with _refilling_engine() as engine:
        loader = _loader(engine, workers=1, context=context, transform=_WithPrevious())
        with _iterating(loader) as iterator:
            for _ in range(12):
                held = next(iterator)
                copy = held["before"].clone()
                for _ in range(3):  # the next batches are fetched while the trainer works on this one
                    next(iterator)
                assert (held["before"] == copy).all()
                del held


def test_receiving_a_slot_of_an_unknown_worker_or_generation_fails_clearly():
    with pytest.raises(RuntimeError, match="never received its slot table"):
        slots_module._receive_slot((1, "unknown-pool"), 0, 0, None, None)
    slots = WorkerSlots(max_slots=1)
    layout = BatchLayout(paths=(("obs",),), dtypes=(torch.float32,), frames=((2,),), batch_shape=(3,))
    slots.acquire(layout)
    key, index, generation, storage, flags = pickle.loads(ForkingPickler.dumps(slots._handover(0)))
    slots_module._receive_slot(key, index, generation, storage, flags)
    with pytest.raises(RuntimeError, match=r"\(generation 7\) by reference before its storage reached"):
        slots_module._receive_slot(key, index, 7, None, None)
    with pytest.raises(RuntimeError, match="before its layout reached this process"):
        slots_module._receive_slot_batch(key, index, generation, None, None, None)


@given(st.integers(min_value=-5, max_value=100))
@settings(deadline=None)  # a loaded CI machine may stall one example past the default
def test_worker_slots_argument_range(count):
    if 0 <= count <= 64:
        assert OnlineDataset(None, chunk_size=2, worker_slots=count).worker_slots == count
    else:
        with pytest.raises(ValueError, match=rf"worker_slots must be an int in \[0, 64\], got {count}"):
            OnlineDataset(None, chunk_size=2, worker_slots=count)
