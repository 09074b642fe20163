"""The body of one producer actor: build the source, generate windows into the actor's own memory.

The actor runs the same "generate a window" half of a producer as a local process
(:func:`~simstream.engine.window.generate_window`) and returns each window by value: its payload frames
``[num_envs, max(length), ...]`` as NumPy arrays (Ray moves them without pickling the bytes) and the checked
``Episode`` reports. The ingest asks for a generation's windows with one streaming call
(:meth:`ProducerActor.stream`), whose items Ray's back-pressure keeps at most ``calls_in_flight`` ahead. It
knows nothing of the trainer's shared memory; the owner's ingest path publishes what it returns. Plain Python:
:mod:`simstream.ray.ingest` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import pickle
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from ray import cloudpickle
from tensordict import TensorDict

from ..engine.window import GeneratedWindow, generate_window
from ..errors import ended_process_error, unsendable_error

__all__ = ["ProducerActor", "WindowFailure", "WindowPayload", "numpy_view"]


@dataclass(frozen=True)
class WindowFailure:
    """The last item of a call's result when a window after the first failed: the windows before it are
    returned (the ingest publishes them, as a local producer would have), then the failure is raised."""

    error: BaseException
    traceback: str = ""
    """The actor's traceback of ``error`` (the text a ``RayTaskError`` carries for the first window)."""


@dataclass(frozen=True)
class WindowPayload:
    """One generated window as it crosses the network."""

    window: GeneratedWindow
    frames: dict[str, np.ndarray]
    """Payload field name (``"obs/state"``) -> ``[num_envs, max(length), *shape]`` frames (dtypes NumPy
    lacks as the integer of their size: :func:`numpy_view`)."""


class ProducerActor:
    """Owns one source and a private payload buffer of ``windows_per_call`` windows ``[num_envs, T]``.

    Calls of the default group run one at a time, in submission order and in one thread; :meth:`stop`
    runs in a separate ``control`` group so it can end a rollout in progress, and :meth:`watch` in a
    ``watch`` group of its own. Window ``k`` of a call (or of a stream's item) is rolled out into slot
    ``k`` of the buffer and returned as a view of it: Ray serialises a result before the thread runs on,
    and no later window of the same result writes that slot, so no window is copied out (one of a
    single row's frames is contiguous).
    """

    def __init__(
        self,
        spec_bytes: bytes,
        worker_index: int,
        seed: int,
        attempts: int,
        check_unwritten_frames: bool,
        windows_per_call: int = 1,
    ) -> None:
        self._spec_bytes = spec_bytes
        self._worker_index = worker_index
        self._seed = seed
        self._attempts = attempts
        self._poison = check_unwritten_frames
        self._slots = windows_per_call
        self._source = None
        self._stop = threading.Event()

    def build(self) -> dict[str, object]:
        """Build the source; returns where the actor runs (``node_id`` hex, ``pid``)."""
        import ray

        torch.set_num_threads(1)
        spec = pickle.loads(self._spec_bytes)
        self._max_steps = steps = spec.max_episode_steps
        num_envs = spec.num_envs
        tree: dict = {}
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, field in dict(spec.fields()).items():
            tensor = torch.zeros((self._slots * num_envs, steps, *field.shape), dtype=field.dtype)
            path = tuple(name.split("/"))
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = tensor
            tensors.append((name, tensor))
        rows = TensorDict(tree, batch_size=[self._slots * num_envs, steps])
        self._rows: list[TensorDict] = []
        """Slot -> the TensorDict of its rows ``[num_envs, T]`` that the source writes."""
        self._arrays: list[list[tuple[str, np.ndarray]]] = []
        """Slot -> field name -> a NumPy view of its rows (the frames are sliced and returned from it)."""
        self._floats: list[list[torch.Tensor]] = []
        """Slot -> its float fields, reset to NaN before every attempt (torch fills every float dtype)."""
        for slot in range(self._slots):
            rows_of_slot = slice(slot * num_envs, (slot + 1) * num_envs)
            self._rows.append(rows[rows_of_slot])
            self._arrays.append([(name, numpy_view(tensor[rows_of_slot])) for name, tensor in tensors])
            self._floats.append(
                [tensor[rows_of_slot] for _, tensor in tensors if tensor.dtype.is_floating_point]
            )
        with _picklable_errors(self._worker_index):
            self._source = spec.build(self._worker_index, self._seed)
        gc.freeze()  # what Ray, torch and the source left behind is never scanned again (see ingest.py)
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def where(self) -> dict[str, object]:
        """Where the actor runs (``node_id`` hex, ``pid``). Runs in the ``control`` group, so it answers
        while :meth:`build` hangs, and a start timeout can name the node."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def generate(self, number: int, count: int = 1) -> list[WindowPayload | WindowFailure]:
        """Roll out windows ``number .. number + count - 1`` of a generation, in order (``count`` is at
        most the ``windows_per_call`` the actor was made with).

        Returns fewer (down to none) only once :meth:`stop` or :meth:`close` ran, or with a
        :class:`WindowFailure` last when a window after the first failed. A failure of the first window
        is raised.
        """
        if not 1 <= count <= self._slots:
            raise ValueError(f"ProducerActor.generate: count must be in [1, {self._slots}], got {count}")
        windows: list[WindowPayload | WindowFailure] = []
        for slot in range(count):
            if self._stop.is_set() or self._source is None:
                break
            reset = partial(self._reset, slot)
            reset()
            try:
                with _picklable_errors(self._worker_index):
                    window = generate_window(
                        self._source,
                        self._rows[slot],
                        number=number + slot,
                        max_steps=self._max_steps,
                        attempts=self._attempts,
                        should_stop=self._stop.is_set,
                        reset=reset,
                    )
            except Exception as error:
                if not windows:
                    raise
                windows.append(WindowFailure(error, "".join(traceback.format_exception(error))))
                break
            if window is None:
                break
            used = max((episode.length for episode in window.episodes), default=0)
            # a view of the slot when contiguous (one row per window); Ray copies it out with the result
            frames = {name: np.ascontiguousarray(array[:, :used]) for name, array in self._arrays[slot]}
            windows.append(WindowPayload(window, frames))
        return windows

    def stream(self, number: int, count: int, per_item: int) -> Iterator[list[WindowPayload | WindowFailure]]:
        """Windows ``number .. number + count - 1`` of a generation, ``per_item`` at a time, as a Ray
        streaming call: one call per generation instead of one per item, and Ray's back-pressure (the
        caller's ``_generator_backpressure_num_objects``) keeps the actor at most that many items ahead of
        the caller, as a bounded number of calls in flight would.

        Every item is what :meth:`generate` returns for its windows; the stream ends after an item with
        fewer windows (stopped) or a :class:`WindowFailure`, and a failure of an item's first window is
        raised (Ray delivers it as that item's error).
        """
        done = 0
        while done < count:
            wanted = min(per_item, count - done)
            windows = self.generate(number + done, wanted)
            if windows:
                yield windows
            if len(windows) < wanted or isinstance(windows[-1], WindowFailure):
                return
            done += wanted

    def stop(self) -> None:
        """Make a rollout in progress (and every later call) return early. Runs in the ``control`` group,
        beside a rollout; :meth:`close` then runs in the thread that built the source."""
        self._stop.set()

    def watch(self, timeout_s: float) -> None:
        """Return after ``timeout_s`` or once :meth:`stop` ran. Runs in the ``watch`` group: the ingest
        keeps one such call outstanding per actor, so an actor that dies while idle (no window call to
        fail) is seen as lost, and restarted, at once."""
        self._stop.wait(timeout_s)

    def close(self) -> None:
        """Close the source (its errors are durability failures), in the thread that built and ran it:
        a renderer's GL context belongs to that thread."""
        self._stop.set()
        source, self._source = self._source, None
        if source is not None:
            with _picklable_errors(self._worker_index):
                source.close()

    def _reset(self, slot: int) -> None:
        """The slot's frames back to unwritten (NaN), so that a reported frame left unwritten is caught on
        ingest."""
        if self._poison:
            for tensor in self._floats[slot]:
                tensor.fill_(math.nan)


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing ``tensor``'s memory. Dtypes NumPy lacks (``bfloat16``, ``float8``...) are
    viewed as the integer of their size, so their bits cross Ray and are copied unchanged; the ingest
    views its targets the same way."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.view(_SAME_SIZE_INTEGER[tensor.element_size()]).numpy()


@contextlib.contextmanager
def _picklable_errors(worker_index: int):
    """Re-raise an exception that cannot be pickled as an ``OnlineDataWorkerError`` with its type, message
    and traceback: Ray must pickle what an actor raises, and an exception holding e.g. a ctypes pointer
    would otherwise kill the actor process (and read as a lost actor instead of the source's error).

    A ``SystemExit`` (a source's ``sys.exit()``) or ``KeyboardInterrupt`` would end the actor process and
    read as a lost actor, restarted; it fails the engine as a local producer's does, with its message.
    """
    try:
        yield
    except (SystemExit, KeyboardInterrupt) as error:
        raise ended_process_error(f"producer-{worker_index}", type(error).__qualname__, str(error)) from None
    except Exception as error:
        try:  # as Ray will: by value for a class of the user's script (__main__), which plain pickle refuses
            cloudpickle.loads(cloudpickle.dumps(error))
        except Exception:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            raise unsendable_error(error, text) from None
        raise
