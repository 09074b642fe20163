"""SharedLanguageRegistry: interning, resolution, exact reference errors and cross-process visibility."""

from __future__ import annotations

import json
import multiprocessing as mp
import re

import pytest
import torch

from simstream.language import SharedLanguageRegistry

pytestmark = pytest.mark.timeout(60)

JOIN_TIMEOUT_S = 60.0


def _line_bytes(kind: str, text: str) -> int:
    return len((json.dumps([kind, text], ensure_ascii=False, separators=(",", ":")) + "\n").encode())


@pytest.fixture
def registry() -> SharedLanguageRegistry:
    return SharedLanguageRegistry(4096, context=mp.get_context("fork"))


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5, "16", None], ids=repr)
def test_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ValueError, match=r"^language_buffer_bytes must be a positive integer, got ") as error:
        SharedLanguageRegistry(capacity)
    assert str(error.value).endswith(f"got {capacity!r}")


def test_default_capacity_and_empty_state():
    registry = SharedLanguageRegistry()
    assert registry.capacity_bytes == 1048576
    assert registry.used_bytes == 0
    assert registry.count("task") == registry.count("subtask") == 0


def test_intern_dedupes_and_indices_are_per_kind(registry):
    assert registry.intern("pick the cube") == 0
    assert registry.intern("place it") == 1
    used = registry.used_bytes
    assert used == _line_bytes("task", "pick the cube") + _line_bytes("task", "place it")
    assert registry.intern("pick the cube") == 0
    assert registry.used_bytes == used, "a known text must consume no bytes"
    assert registry.intern("pick the cube", kind="subtask") == 0
    assert registry.intern("place it", kind="subtask") == 1
    assert registry.count("task") == 2 and registry.count("subtask") == 2


def test_indices_are_immutable_as_entries_grow(registry):
    texts = [f"instruction {i}" for i in range(50)]
    first = [registry.intern(text) for text in texts]
    assert first == list(range(50))
    for i in range(50, 80):
        registry.intern(f"instruction {i}", kind="subtask")
    assert [registry.intern(text) for text in texts] == first
    assert registry.resolve(torch.arange(50)) == texts


@pytest.mark.parametrize(
    "text",
    ["line one\nline two", "naïve café — 日本語 🤖", "sep\u2028arator\u0085", '"quoted" [json] ,:'],
    ids=["newline", "unicode", "unicode-line-breaks", "json-syntax"],
)
def test_texts_round_trip(registry, text):
    registry.intern("padding entry")
    index = registry.intern(text)
    assert registry.resolve(torch.tensor(index)) == text
    other = SharedLanguageRegistry.__new__(SharedLanguageRegistry)
    other.__setstate__(registry.__getstate__())
    assert other.resolve(torch.tensor([0, index])) == ["padding entry", text]


@pytest.mark.parametrize("kind", ["Task", "", "episode", None])
def test_unknown_kind(registry, kind):
    with pytest.raises(ValueError, match=r"^language kind must be task or subtask, got "):
        registry.intern("x", kind=kind)
    with pytest.raises(ValueError, match=r"^language kind must be task or subtask, got "):
        registry.resolve(torch.tensor([0]), kind=kind)


@pytest.mark.parametrize("description", ["", "   ", "\n\t", None, 3, b"bytes"], ids=repr)
def test_blank_or_non_text_description(registry, description):
    with pytest.raises(ValueError, match=r"^language description must be nonempty text$"):
        registry.intern(description)
    assert registry.used_bytes == 0


def test_text_utf8_cannot_encode_is_refused_naming_it_and_nothing_is_written(registry):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "language description must be valid Unicode text (UTF-8 encodable), got 'bad \\udc80' "
            "(surrogates not allowed)"
        ),
    ):
        registry.intern("bad \udc80")
    assert registry.used_bytes == 0


def test_overflow_writes_nothing_and_keeps_working():
    capacity = _line_bytes("task", "fits") + 4
    registry = SharedLanguageRegistry(capacity, context=mp.get_context("fork"))
    assert registry.intern("fits") == 0
    expected = (
        f"Online language registry exhausted language_buffer_bytes={capacity}; "
        "increase the capacity and create a new engine."
    )
    with pytest.raises(OverflowError) as info:
        registry.intern("does not fit")
    assert str(info.value) == expected
    assert registry.used_bytes == _line_bytes("task", "fits")
    assert registry.count("task") == 1 and registry.count("subtask") == 0
    assert registry.intern("fits") == 0, "known texts still resolve after an overflow"
    assert registry.resolve(torch.tensor([0])) == ["fits"]


def test_exact_fit_is_accepted():
    registry = SharedLanguageRegistry(_line_bytes("subtask", "ab"), context=mp.get_context("fork"))
    assert registry.intern("ab", kind="subtask") == 0
    assert registry.used_bytes == registry.capacity_bytes


def test_resolve_shapes(registry):
    for text in ("a", "b", "c"):
        registry.intern(text)
    assert registry.resolve(torch.tensor(2)) == "c"
    assert registry.resolve(torch.tensor([2, 0, 2])) == ["c", "a", "c"]
    batch = torch.tensor([[0, 1, 1], [2, 2, 0]], dtype=torch.int32)
    assert registry.resolve(batch) == [["a", "b", "b"], ["c", "c", "a"]]
    cube = torch.arange(12).reshape(2, 3, 2) % 3
    assert registry.resolve(cube) == [[["abc"[v] for v in row] for row in plane] for plane in cube.tolist()]
    assert registry.resolve(torch.zeros(0, dtype=torch.long)) == []
    assert registry.resolve(torch.zeros(2, 0, dtype=torch.long)) == [[], []]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_resolve_accepts_integer_dtypes(registry, dtype):
    registry.intern("zero")
    registry.intern("one")
    assert registry.resolve(torch.tensor([1, 0], dtype=dtype)) == ["one", "zero"]


@pytest.mark.parametrize(
    "indices",
    [torch.tensor([0.0]), torch.tensor([True]), [0], 0, torch.tensor([0], dtype=torch.uint16)],
    ids=["float", "bool", "list", "int", "uint16"],
)
def test_resolve_rejects_non_integer_tensors(registry, indices):
    registry.intern("zero")
    with pytest.raises(TypeError, match=r"^language indices must be an integer tensor$"):
        registry.resolve(indices)


def test_resolve_rejects_unknown_indices(registry):
    registry.intern("zero")
    registry.intern("one")
    with pytest.raises(ValueError, match=r"^Unknown online task index -1$"):
        registry.resolve(torch.tensor([[0, -1], [1, 0]]))
    with pytest.raises(ValueError, match=r"^Unknown online task index 2$"):
        registry.resolve(torch.tensor(2))
    with pytest.raises(ValueError, match=r"^Unknown online subtask index 0$"):
        registry.resolve(torch.tensor([0]), kind="subtask")
    with pytest.raises(ValueError, match=r"^Unknown online task index 5$"):
        registry.resolve(torch.tensor([5, -3]))


def test_copies_see_each_others_entries(registry):
    other = SharedLanguageRegistry.__new__(SharedLanguageRegistry)
    other.__setstate__(registry.__getstate__())
    assert set(registry.__getstate__()) == {"_buffer", "_length", "_append_lock"}
    assert registry.intern("from the first") == 0
    assert other.resolve(torch.tensor([0])) == ["from the first"]
    assert other.intern("from the second") == 1
    assert other.intern("from the first") == 0
    assert registry.resolve(torch.tensor([1, 0])) == ["from the second", "from the first"]
    assert registry.intern("third") == 2


def _interrupt_the_parse_at(monkeypatch, line: int) -> None:
    """The ``line``-th line a registry parses from now on raises KeyboardInterrupt (a Ctrl-C)."""
    import simstream.language

    calls, loads = [], json.loads

    def interrupted(text):
        calls.append(None)
        if len(calls) == line:
            raise KeyboardInterrupt
        return loads(text)

    monkeypatch.setattr(simstream.language.json, "loads", interrupted)


def test_a_parse_cut_short_by_a_ctrl_c_leaves_every_index_right(registry, monkeypatch):
    """A Ctrl-C in the owner's refresh once left the texts parsed before it in the cache, parsed again
    by the next refresh: counts grew, indices resolved to other texts, and new texts got wrong ids."""
    other = SharedLanguageRegistry.__new__(SharedLanguageRegistry)
    other.__setstate__(registry.__getstate__())
    assert registry.intern("first") == 0
    for text in ("second", "third", "fourth"):
        other.intern(text)
    other.intern("a subtask", kind="subtask")
    with monkeypatch.context() as patch:
        _interrupt_the_parse_at(patch, 3)  # "second" and "third" parsed, then the Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            registry.count()
    assert registry.count() == 4 and registry.count("subtask") == 1
    assert registry.resolve(torch.tensor([3, 1, 0])) == ["fourth", "second", "first"]
    assert registry.intern("third") == 2 and registry.intern("fifth") == 4
    assert other.resolve(torch.tensor([4])) == ["fifth"]


def test_an_intern_cut_short_after_its_entry_is_written_keeps_its_index(registry, monkeypatch):
    """Written to the shared bytes, its index is every process's: the interrupted process knows it too
    (it had marked the entry parsed before adding it to its cache, and lost it)."""
    other = SharedLanguageRegistry.__new__(SharedLanguageRegistry)
    other.__setstate__(registry.__getstate__())
    assert registry.intern("first") == 0
    with monkeypatch.context() as patch:
        _interrupt_the_parse_at(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            registry.intern("second")
    assert other.intern("second") == 1
    assert registry.intern("second") == 1 and registry.count() == 2
    assert registry.resolve(torch.tensor([1])) == ["second"]


def _child_interns_and_resolves(registry, child_done, parent_done) -> None:
    assert registry.resolve(torch.tensor([0])) == ["set by the parent"]
    assert registry.intern("set by the child\nwith ünïcode") == 1
    assert registry.intern("child subtask", kind="subtask") == 0
    assert registry.intern("set by the parent") == 0
    child_done.set()
    if not parent_done.wait(JOIN_TIMEOUT_S):
        raise SystemExit(3)
    assert registry.resolve(torch.tensor([[2, 0]])) == [["set later by the parent", "set by the parent"]]


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_entries_cross_process_boundaries(method):
    ctx = mp.get_context(method)
    registry = SharedLanguageRegistry(4096, context=ctx)
    assert registry.intern("set by the parent") == 0
    child_done, parent_done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_child_interns_and_resolves, args=(registry, child_done, parent_done))
    child.start()
    try:
        assert child_done.wait(JOIN_TIMEOUT_S), "child did not intern in time"
        assert registry.resolve(torch.tensor(1)) == "set by the child\nwith ünïcode"
        assert registry.resolve(torch.tensor([0]), kind="subtask") == ["child subtask"]
        assert registry.intern("set by the child\nwith ünïcode") == 1
        assert registry.intern("set later by the parent") == 2
        parent_done.set()
        child.join(JOIN_TIMEOUT_S)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(JOIN_TIMEOUT_S)


def test_threads_of_one_process_refreshing_at_once_keep_indices_right():
    """The per-process cache is parsed under a thread lock: two threads never add one line twice."""
    import threading as _threading

    writer = SharedLanguageRegistry(1 << 16, context=mp.get_context("fork"))
    reader = SharedLanguageRegistry.__new__(SharedLanguageRegistry)
    reader.__setstate__(writer.__getstate__())
    texts = [f"task {i}" for i in range(200)]
    for text in texts:
        writer.intern(text)
    barrier = _threading.Barrier(4)

    def resolve_all() -> None:
        barrier.wait(30)
        assert reader.resolve(torch.tensor([199])) == ["task 199"]

    threads = [_threading.Thread(target=resolve_all) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert reader.count("task") == 200
    assert reader.resolve(torch.arange(200)) == texts
    assert reader.intern("task 7") == 7 and reader.intern("new") == 200
