"""The trainer-side half of the Ray backend: the ingest process, its actors, restarts and shutdown.

The engine starts one **ingest process** on the trainer's machine (:func:`run_ingest`, supervised like a local
producer: its exceptions reach the error channel, its death is detected, ``stop()`` ends it in its bound). It
is a Ray driver of its own: it connects to the cluster, owns the producer actors (so they die with it,
whatever ends it) and publishes their windows into the shared buffer. Running it beside the trainer rather
than as a thread inside it keeps the two from competing for one interpreter lock: as a thread, two Ray
producers delivered 0.5 episodes/s while the demo trained, against 5.3 for two local producers.
:class:`RayProducers` drives every actor: it asks an actor for a window only while the engine's requested
generation is ahead of what that producer completed (idle producers stay idle), with one streaming call per
generation (:meth:`~simstream.ray.actor.ProducerActor.stream`) whose items of ``windows_per_call`` windows
Ray's back-pressure keeps at most ``calls_in_flight`` ahead of the ingest, and waits on Ray with ``ray.wait``
in short slices, holding no lock meanwhile. A stream costs the ingest and the actor one submission per
generation instead of one per item (``BENCHMARKS.md``, run 12). The windows that arrive from a producer's
consecutive items are held for at most ``publish_delay_s`` (up to ``publish_windows`` of them; a generation's
last window ends the group at once) and published together with
:class:`~simstream.engine.publisher.WindowPublisher`: one claim of all their rows, the payloads copied in, one
write pass, one publication (one lock hold, one lifecycle append), with the same records, ids and order as
one-by-one publication; a producer's last window, whose rows may overlap the one before, is published on its
own. Held windows are not visible yet; windows held when the engine stops are never published, like windows
still in flight. The ingest process is the single writer of its producers' progress rows. Failures:

* an exception in the source arrives as Ray's task error; its cause (the original exception) is
  published on the error channel, so the owner and every consumer raise it;
* a lost actor (process killed, node gone, object lost) is replaced by a fresh actor with a new seed
  after ``restart_delay_s``, and the windows it had in flight are asked again; none of them was visible
  (rows are claimed only when a window has arrived);
* restarts exhausted, or a call or an actor start past ``call_timeout_s``: :class:`RayProducerError`.
"""

from __future__ import annotations

import gc
import logging
import pickle
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from ray.exceptions import (
    GetTimeoutError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayError,
    RayTaskError,
    WorkerCrashedError,
)

from ..config import OnlineDataEngineCfg
from ..engine.producer import publish_owner_gone
from ..engine.publisher import Closing, WindowPublisher
from ..engine.shared import EngineShared
from ..engine.window import derive_worker_seed, window_starts
from ..errors import OnlineDataWorkerError, unsendable_error
from ..workers.supervisor import ShutdownReport, owner_watch
from .actor import ProducerActor, WindowFailure, WindowPayload, numpy_view
from .backend import RayBackend, RayProducerError

__all__ = ["RayProducers", "run_ingest"]

logger = logging.getLogger(__name__)

_SLICE_S = 0.05
"""Longest single wait on Ray or on a refill request; every slice ends with the stop and failure checks."""
_WATCH_POLL_S = 0.5
"""How often the ingest looks at its actors' watch calls: a lost idle actor is restarted this late at most."""
_WATCH_CALL_S = 30.0
"""Longest single watch call; a call that returned is renewed."""
_STREAMS_AHEAD = 2
"""Streaming calls outstanding per actor: the current generation's and, once requested, the next one's."""
_LOSSES = (RayActorError, NodeDiedError, ObjectLostError, OutOfMemoryError, WorkerCrashedError)
"""Ray's errors for a producer that is gone (its process, its node or its result): restarted. Any other
``RayError`` (a result that cannot be deserialized here, a runtime environment that cannot be set up, ...)
would fail the same way again: the engine fails with Ray's error."""
_DURABILITY_MESSAGE = (
    "OnlineDataEngine Ray producer did not close its source in time and was killed; graceful close and "
    "recorder durability could not be confirmed."
)


def run_ingest(
    shared: EngineShared,
    cfg_bytes: bytes,
    spec_bytes: bytes,
    num_envs: int,
    address: str | None,
    joining=None,
) -> None:
    """Body of the ingest process (started through :func:`~simstream.workers.supervisor.worker_entry`).

    Args:
        shared: The engine's shared objects.
        cfg_bytes: The pickled engine config.
        spec_bytes: ``cfg.source`` pickled by value (cloudpickle) in the owner, for the actors.
        num_envs: Rows per window.
        address: The Ray cluster to join (``None``: ``RAY_ADDRESS`` or a new local cluster).
        joining: A shared double: when the owner launched this process, until it has connected to Ray
            (the owner's stop waits for that, see :meth:`RayProducers.start`), then 0.0.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides; its stop() ends this process
    torch.set_num_threads(1)
    cfg = pickle.loads(cfg_bytes)
    producers = RayProducers(shared, cfg, num_envs, spec_bytes, address, joining)
    try:
        if not producers.start():
            return  # stopped before it connected
        # ray.init installs a SIGTERM handler that raises SystemExit, which would be published as this
        # process's failure when the owner terminates it after its shutdown_timeout: die as a signal does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Ray, torch and NumPy leave hundreds of thousands of objects behind; every full collection
        # would walk them all, and unpickling each call's episode reports triggers one every few
        # thousand episodes. Frozen, they are never scanned: the ingest's CPU per episode fell by a
        # fifth to a third (BENCHMARKS.md, "Ray producers", run 6).
        gc.freeze()
        producers.run()
        if not shared.close_flag.is_set():  # it returned for the owner's death or a failure, not a stop()
            publish_owner_gone(shared, "ray-ingest")
    finally:
        # the sources' close() has shutdown_timeout, as a local producer's; the owner waits RAY_LEAVE_S
        # longer for this process, for the actors' kills and leaving Ray
        report = producers.shutdown(cfg.shutdown_timeout)
        if report.forced:
            shared.channel.publish_durability_failure(
                OnlineDataWorkerError(_DURABILITY_MESSAGE), "ray-ingest"
            )
        shared.progress.notify()


@dataclass(frozen=True)
class _Item:
    """The windows one item of a stream carries: ``number .. number + count - 1`` of ``generation``."""

    number: int
    count: int
    generation: int


@dataclass
class _Stream:
    """One streaming call: the windows ``number .. end - 1`` of ``generation`` not received yet."""

    generator: object
    """Ray's ``ObjectRefGenerator`` of the call (at shutdown the ingest takes its ready items, so that an
    actor waiting on back-pressure goes on and sees the stop: see ``_close_actors``)."""
    number: int
    end: int
    generation: int
    item: object = None
    """The next item's reference once taken from the generator, until its value is received."""

    @property
    def head(self) -> object:
        """What the ingest waits on: the item taken, else the generator (ready with its next item)."""
        return self.generator if self.item is None else self.item

    def next_item(self, per_item: int) -> _Item:
        return _Item(self.number, min(per_item, self.end - self.number), self.generation)


@dataclass
class _Producer:
    """The owner's view of one producer actor (touched by the ingest thread only)."""

    index: int
    starts: list[int]
    actor: object = None
    build_ref: object = None
    watch_ref: object = None
    where_ref: object = None
    """The actor's :meth:`ProducerActor.where` call: its node, known even while its build hangs."""
    """The outstanding :meth:`ProducerActor.watch` call: fails as soon as the actor is lost."""
    node_id: str | None = None
    pid: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    calls: deque = field(default_factory=deque)
    """Outstanding streaming calls (:class:`_Stream`), oldest first: at most one generation's behind it."""
    head_since: float = 0.0
    """When the oldest stream's next item (or the build) became the one its actor works on."""
    next_generation: int = 1
    next_number: int = 0
    began_ns: dict[int, int] = field(default_factory=dict)
    """Generation -> when its first call was issued (``production_ns``, as a local producer times it)."""
    closed: bool = False
    held: list = field(default_factory=list)
    """Windows that arrived and wait to be published together: ``held_number, held_number + 1, ...``."""
    held_number: int = 0
    held_generation: int = 0
    held_since: float = 0.0

    @property
    def label(self) -> str:
        return f"producer-{self.index}"


class RayProducers:
    """Owns the producer actors of one engine and the ingest thread that publishes their windows.

    Args:
        shared: The engine's shared objects.
        cfg: The engine config (``cfg.backend`` is a :class:`RayBackend`).
        num_envs: Rows per window.
    """

    def __init__(
        self,
        shared: EngineShared,
        cfg: OnlineDataEngineCfg,
        num_envs: int,
        spec_bytes: bytes,
        address: str | None,
        joining=None,
    ):
        self._shared = shared
        self._cfg = cfg
        self._backend: RayBackend = cfg.backend
        self._spec_bytes = spec_bytes
        self._address = address
        self._joining = joining
        self._num_envs = num_envs
        self._stop = threading.Event()
        self._owner_gone = owner_watch()
        self._initialized_ray = False
        self._actor_class = None
        self._next_watch_check = 0.0
        self._producers = [
            _Producer(worker, window_starts(start, end, num_envs))
            for worker, (start, end) in enumerate(cfg.worker_row_ranges(num_envs))
        ]
        self._publishers = [WindowPublisher(shared, p.index, self._closing) for p in self._producers]
        self._payload_views: dict[int, dict[str, np.ndarray]] = {}
        """Window start -> field name -> the window's rows ``[num_envs, T, ...]`` (built once per window)."""

    # -- lifecycle (in the ingest process) ------------------------------------------------------------
    def start(self) -> bool:
        """Connect to Ray and start every actor (building happens in the actors); ``False`` when the
        engine was stopped before this process connected (it then never starts a cluster only to leave).

        The owner set ``joining`` when it launched this process and waits while it is set: imports and
        ``ray.init`` (a local cluster takes seconds to start) cannot be interrupted. It is cleared once
        connected, or once the stop is seen here first. The stop sets the close flag before it reads
        ``joining``, and this process reads the flag only while ``joining`` is still set, so a stop is
        either seen here or waited for there.
        """
        try:
            if not ray.is_initialized():
                if self._shared.close_flag.is_set():
                    return False
                ray.init(address=self._address, logging_level=logging.WARNING)
                self._initialized_ray = True
        finally:
            if self._joining is not None:
                self._joining.value = 0.0
        self._actor_class = ray.remote(concurrency_groups={"control": 1, "watch": 1})(ProducerActor)
        for producer in self._producers:
            self._start_actor(producer)
        return True

    def shutdown(self, timeout_s: float) -> ShutdownReport:
        """Close every source (bounded by ``timeout_s``), then kill every actor and leave Ray.

        A source whose ``close()`` raised is a durability failure on the error channel; an actor that
        did not close in time makes the report ``forced``. Killing returns the actors' resources to the
        cluster whatever happened before.
        """
        report = ShutdownReport()
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        try:
            self._close_actors(deadline, report)
        except Exception as error:  # Ray is gone (disconnected, shut down): the closes are unconfirmed
            logger.warning("closing the producer actors failed: %s", error)
            report.forced = True
        finally:
            for producer in self._producers:
                self._kill(producer)
            if self._initialized_ray:
                ray.shutdown()
                self._initialized_ray = False
        return report

    # -- actors --------------------------------------------------------------------------------------
    def _start_actor(self, producer: _Producer) -> None:
        backend, cfg = self._backend, self._cfg
        options = {
            "num_cpus": float(backend.num_cpus),  # Ray takes int or float only (not NumPy numbers)
            "resources": {name: float(amount) for name, amount in backend.resources.items()},
            "max_restarts": 0,  # restarts are ours: a fresh source with a new seed, and a budget we count
            "max_concurrency": 1,
            "name": None,
        }
        if backend.runtime_env is not None:
            options["runtime_env"] = dict(backend.runtime_env)
        options = {key: value for key, value in options.items() if value is not None}
        seed = derive_worker_seed(cfg.seed, producer.index, producer.restarts)
        producer.actor = self._actor_class.options(**options).remote(
            self._spec_bytes,
            producer.index,
            seed,
            cfg.max_generation_attempts,
            cfg.check_unwritten_frames,
            backend.windows_per_call,
        )
        producer.build_ref = producer.actor.build.remote()
        producer.where_ref = producer.actor.where.options(concurrency_group="control").remote()
        producer.head_since = time.monotonic()
        producer.node_id, producer.pid = None, 0

    def _kill(self, producer: _Producer) -> None:
        actor, producer.actor = producer.actor, None
        producer.calls.clear()
        producer.build_ref = producer.watch_ref = producer.where_ref = None
        if actor is None:
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception as error:  # Ray already shut down (interpreter exit): its actors died with it
            logger.debug("ray.kill of %s failed: %s", producer.label, error)

    def _close_actors(self, deadline: float, report: ShutdownReport) -> None:
        refs, streams = {}, []
        for producer in self._producers:
            built = producer.build_ref is None or bool(ray.wait([producer.build_ref], timeout=0)[0])
            # built (whether or not its result was received), or running its build: its source may exist
            # by the time close() runs, as a local producer's built while the engine stops is closed too.
            # An actor not placed yet has nothing to close
            if producer.actor is not None and (built or self._placed_on(producer) is not None):
                # stop ends the rollout in progress and makes every later window return at once; close,
                # queued behind the streams (or the build), then closes the source in the thread that
                # built it
                producer.actor.stop.options(concurrency_group="control").remote()
                streams += [stream.generator for stream in producer.calls]
                producer.calls.clear()
                refs[producer.actor.close.remote()] = producer
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            # a stream waiting for room (Ray's back-pressure) never sees the stop: take its items, so
            # that it goes on, finds the stop and returns. Dropping the generators would release it
            # too, but only once nothing refers to them any more, and a failure's traceback (kept on
            # the error channel) can keep the frames that do alive
            streams = _drain(streams)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_SLICE_S)
        streams.clear()
        for ref, producer in refs.items():
            if ref in pending:
                report.forced = True
                logger.warning("%s did not close its source in time; killing its actor", producer.label)
                continue
            try:
                ray.get(ref, timeout=0)
            except RayTaskError as error:
                self._shared.channel.publish_durability_failure(_original(error), producer.label)
            except _LOSSES as error:  # gone before or while closing: its close() is unconfirmed
                message = (
                    f"Ray producer {producer.label} on node {producer.node_id or 'unknown'} was lost before "
                    f"its source's close() returned ({_describe(error)}): recorder durability could not be "
                    "confirmed."
                )
                logger.warning(message)
                self._shared.channel.publish_durability_failure(
                    RayProducerError(message, producer.label, producer.node_id, producer.restarts),
                    producer.label,
                )
            except RayError as error:
                logger.warning("%s could not report its close(): %s", producer.label, error)
                report.forced = True

    # -- the ingest loop -----------------------------------------------------------------------------
    def _closing(self) -> bool:
        return self._stop.is_set() or self._shared.close_flag.is_set() or self._owner_gone()

    def run(self) -> None:
        """Ask for, receive and publish windows until the engine closes, fails or its owner is gone."""
        progress = self._shared.progress
        try:
            while not self._closing() and not self._shared.channel.is_set():
                now = time.monotonic()
                self._check_watches(now)
                for producer in self._producers:
                    self._issue(producer, now)
                    self._check_timeout(producer, now)
                heads = {}
                for producer in self._producers:
                    head = producer.build_ref or (producer.calls[0].head if producer.calls else None)
                    if head is not None:
                        heads[head] = producer
                if not heads:
                    for producer in self._producers:
                        self._publish_held(producer)
                    progress.wait_for_request(0, _SLICE_S)
                    continue
                ready, _ = ray.wait(list(heads), num_returns=1, timeout=self._wait_slice(now))
                for head in ready:
                    self._receive(heads[head], head)
                self._publish_overdue()
        except Closing:
            pass
        except BaseException as error:
            self._shared.channel.publish(error, "ray-ingest")
        finally:
            progress.notify()

    def _wait_slice(self, now: float) -> float:
        """How long the next ``ray.wait`` may block: a slice, or less when held windows fall due sooner."""
        due = min((p.held_since for p in self._producers if p.held), default=None)
        if due is None:
            return _SLICE_S
        return min(_SLICE_S, max(0.0, due + self._backend.publish_delay_s - now))

    def _publish_overdue(self) -> None:
        now = time.monotonic()
        for producer in self._producers:
            if producer.held and now - producer.held_since >= self._backend.publish_delay_s:
                self._publish_held(producer)

    def _issue(self, producer: _Producer, now: float) -> None:
        if producer.actor is None:
            if now >= producer.restart_at:
                self._start_actor(producer)
            return
        if producer.build_ref is not None:
            return
        requested = self._shared.progress.requested_generation
        backend, end = self._backend, len(producer.starts)
        # the next generation's stream waits on the actor behind the current one, so the actor starts it
        # as soon as the current one ends; Ray's back-pressure bounds how far each runs ahead (an option
        # with a leading underscore, as Ray Data uses it: test_an_actor_runs_at_most_calls_in_flight_...
        # pins its meaning, made items not yet taken, on each Ray version the tests run with)
        while len(producer.calls) < _STREAMS_AHEAD and producer.next_generation <= requested:
            if not producer.calls:
                producer.head_since = now
            if producer.next_number == 0:
                producer.began_ns.setdefault(producer.next_generation, time.monotonic_ns())
            stream = producer.actor.stream.options(
                _generator_backpressure_num_objects=backend.calls_in_flight
            ).remote(producer.next_number, end - producer.next_number, backend.windows_per_call)
            producer.calls.append(_Stream(stream, producer.next_number, end, producer.next_generation))
            producer.next_generation, producer.next_number = producer.next_generation + 1, 0

    def _receive(self, producer: _Producer, head) -> None:
        """Receive what ``head`` (the build, or the oldest stream's next item) made ready."""
        stream = None if head is producer.build_ref else producer.calls[0]
        try:
            if stream is not None and stream.item is None:
                stream.item = next(stream.generator)
            value = ray.get(head if stream is None else stream.item, timeout=0)
        except StopIteration:  # the stream returned early, which only a stopped actor does
            producer.calls.popleft()
            producer.head_since = time.monotonic()
            self._publish_held(producer)
            if not self._closing():
                self._fail(
                    producer,
                    producer.node_id,
                    f"its stream of generation {stream.generation} ended before window {stream.number + 1}",
                    "failed",
                )
            return
        except RayTaskError as error:  # the source (or the window's check) raised: fatal, as locally
            self._publish_held(producer)  # the windows before the failing one are visible, as locally
            self._shared.channel.publish(_original(error), producer.label)
            raise Closing from None
        except _LOSSES as error:  # the actor, its node or the result was lost
            self._lost(producer, error)
            return
        except GetTimeoutError:  # ready, but its copy left this node meanwhile: waited on again
            return
        except RayError as error:
            self._publish_held(producer)
            self._fail(
                producer, producer.node_id, f"Ray could not deliver its result ({_describe(error)})", "failed"
            )
        now = time.monotonic()
        if stream is None:
            producer.build_ref = None
            producer.node_id, producer.pid = value["node_id"], value["pid"]
            self._shared.progress.set_worker_pid(producer.index, producer.pid)
            self._shared.progress.set_worker_node(producer.index, producer.node_id)
            self._watch(producer)
            return
        item = stream.next_item(self._backend.windows_per_call)
        stream.item = None
        stream.number += len(value)
        if stream.number >= stream.end or len(value) < item.count:
            # its last item (or it was stopped): the end of the stream is not waited for
            producer.calls.popleft()
        producer.head_since = now
        if value and isinstance(value[-1], WindowFailure):
            # windows before the failing one arrived whole: visible first, as a local producer's
            self._hold(producer, item, value[:-1], now)
            self._publish_held(producer)
            failure = value[-1]
            self._shared.channel.publish(_sendable(failure.error, failure.traceback), producer.label)
            raise Closing
        self._hold(producer, item, value, now)

    def _hold(self, producer: _Producer, item: _Item, payloads: list[WindowPayload], now: float) -> None:
        """Keep the windows of a stream's item that arrived with those held before it; publish the group
        once it is full, ends the generation, or (with ``publish_delay_s == 0``) at once."""
        backend = self._backend
        if producer.held and (
            item.generation != producer.held_generation
            or item.number != producer.held_number + len(producer.held)
            or len(producer.held) + len(payloads) > backend.publish_windows
        ):
            self._publish_held(producer)  # not consecutive (a safety check), or the group would be too big
        if not producer.held:
            producer.held_number, producer.held_generation, producer.held_since = (
                item.number,
                item.generation,
                now,
            )
        producer.held.extend(payloads)
        if (
            len(payloads) < item.count
            or item.number + item.count == len(producer.starts)
            or len(producer.held) >= backend.publish_windows
            or backend.publish_delay_s == 0
        ):
            self._publish_held(producer)

    def _publish_held(self, producer: _Producer) -> None:
        """Publish the held windows in as few groups as their rows allow: consecutive windows with
        disjoint rows go together (one claim, one publication); only a producer's last window, which may
        overlap the one before, starts a group of its own, so every row's records are those of one-by-one
        publication. A failure (e.g. a reported frame left unwritten) fails the engine, as locally."""
        payloads, producer.held = producer.held, []
        number, generation, starts = producer.held_number, producer.held_generation, producer.starts
        try:
            first = 0
            for offset in range(1, len(payloads) + 1):
                if (
                    offset == len(payloads)
                    or starts[number + offset] != starts[number + offset - 1] + self._num_envs
                ):
                    self._publish(producer, number + first, generation, payloads[first:offset])
                    first = offset
        except Closing:
            raise
        except Exception as error:
            self._shared.channel.publish(error, producer.label)
            raise Closing from None

    def _publish(
        self, producer: _Producer, number: int, generation: int, payloads: list[WindowPayload]
    ) -> None:
        """Publish consecutive windows ``number, number + 1, ...`` (disjoint rows) together."""
        progress = self._shared.progress
        num_envs = self._num_envs
        start = producer.starts[number]
        end = start + num_envs * len(payloads)
        publisher = self._publishers[producer.index]
        for payload in payloads:
            if payload.window.failed_episodes:
                publisher.count_failed(payload.window.failed_episodes)
        try:
            if not publisher.begin(start, end, num_envs):
                raise Closing
            for offset, payload in enumerate(payloads):
                targets = self._targets(start + offset * num_envs)
                for name, frames in payload.frames.items():
                    np.copyto(targets[name][:, : frames.shape[1]], frames)
            publisher.finish(start, end, [payload.window for payload in payloads], generation)
        finally:
            publisher.abandon()
        if number + len(payloads) == len(producer.starts):
            began = producer.began_ns.pop(generation, None)
            if began is not None:
                progress.add_for_worker(producer.index, "production_ns", time.monotonic_ns() - began)
            progress.set_worker_completed(producer.index, generation)

    def _targets(self, start: int) -> dict[str, np.ndarray]:
        views = self._payload_views.get(start)
        if views is None:
            rows = self._shared.storage.rows_view(start, start + self._num_envs, payload_only=True)
            views = {}
            for spec in self._shared.storage.iter_specs(payload=True):
                views[spec.name] = numpy_view(rows.get(spec.path))  # as the actor viewed its rows
            self._payload_views[start] = views
        return views

    def _lost(self, producer: _Producer, error: BaseException) -> None:
        self._publish_held(producer)  # arrived whole before the loss: as good as any other window
        first = producer.calls[0] if producer.calls else None
        node = producer.node_id or self._placed_on(producer)  # a replacement lost while building has one too
        self._kill(producer)
        progress = self._shared.progress
        progress.set_worker_pid(producer.index, 0)  # no actor until the replacement is built
        progress.set_worker_node(producer.index, None)
        if producer.restarts >= self._backend.max_restarts:
            self._fail(producer, node, f"its actor was lost ({_describe(error)})", "restarts exhausted")
        producer.restarts += 1
        self._shared.progress.set_worker_restarts(producer.index, producer.restarts)
        if first is not None:  # ask again for every window that was in flight, from the oldest
            producer.next_generation, producer.next_number = first.generation, first.number
        producer.restart_at = time.monotonic() + self._backend.restart_delay_s
        logger.warning(
            "%s on node %s was lost (%s); restart %d of %d",
            producer.label,
            node,
            _describe(error),
            producer.restarts,
            self._backend.max_restarts,
        )

    def _watch(self, producer: _Producer) -> None:
        watch = producer.actor.watch.options(concurrency_group="watch")
        producer.watch_ref = watch.remote(_WATCH_CALL_S)

    def _check_watches(self, now: float) -> None:
        """Every ``_WATCH_POLL_S``: restart the producers whose actor was lost while no window call of theirs
        was outstanding to report it; renew the watch calls that returned."""
        if now < self._next_watch_check:
            return
        self._next_watch_check = now + _WATCH_POLL_S
        watched = {p.watch_ref: p for p in self._producers if p.watch_ref is not None}
        if not watched:
            return
        ready, _ = ray.wait(list(watched), num_returns=len(watched), timeout=0)
        for ref in ready:
            producer = watched[ref]
            try:
                ray.get(ref, timeout=0)
            except _LOSSES as error:
                self._lost(producer, error)
                continue
            except GetTimeoutError:
                continue
            except RayError as error:  # would fail the same way again, as a window call's does
                self._publish_held(producer)
                self._fail(
                    producer, producer.node_id, f"its watch call failed ({_describe(error)})", "failed"
                )
            self._watch(producer)

    def _check_timeout(self, producer: _Producer, now: float) -> None:
        if producer.build_ref is None and not producer.calls:
            return
        backend = self._backend
        if producer.build_ref is not None:
            limit = backend.start_timeout_s
            what = (
                "starting its actor and building its source did not finish within "
                f"RayBackend.start_timeout_s={limit} s"
            )
        else:  # an item of k windows may take k times the limit of one
            count = producer.calls[0].next_item(backend.windows_per_call).count
            limit = backend.call_timeout_s * count
            what = (
                f"a window call did not finish within RayBackend.call_timeout_s={backend.call_timeout_s} s"
                if count == 1
                else f"a call of {count} windows did not finish within {limit:g} s "
                f"(RayBackend.call_timeout_s={backend.call_timeout_s} s per window)"
            )
        if now - producer.head_since <= limit:
            return
        head = producer.build_ref or producer.calls[0].head
        # done on its actor's node counts, whether or not its copy has reached this one yet
        if ray.wait([head], timeout=0, fetch_local=False)[0]:
            # finished, only not received yet: the ingest itself was held up (e.g. waiting for room in the
            # lifecycle log, or for the recorder), which is back-pressure, not a hang of the actor
            return
        node = producer.node_id or self._placed_on(producer)
        self._publish_held(producer)  # arrived whole before the hang: visible, as a local producer's
        self._kill(producer)
        self._fail(producer, node, f"{what} (GetTimeoutError)", "timed out")

    def _placed_on(self, producer: _Producer) -> str | None:
        """The node of an actor whose build has not returned, if the actor runs (None: not placed)."""
        ref = producer.where_ref
        if ref is None or not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            return ray.get(ref, timeout=0)["node_id"]
        except Exception:  # lost meanwhile: the node is unknown
            return None

    def _fail(self, producer: _Producer, node: str | None, what: str, outcome: str) -> None:
        backend = self._backend
        error = RayProducerError(
            f"Ray producer {producer.label} on node {node or 'unknown (its actor never started)'}: {what}; "
            f"{outcome} after {producer.restarts} restart(s) of max_restarts={backend.max_restarts}.",
            producer.label,
            node,
            producer.restarts,
        )
        self._shared.channel.publish(error, producer.label)
        raise Closing


def _drain(streams: list) -> list:
    """Take (and drop) every item that is ready in ``streams``; returns the streams not ended yet."""
    if not streams:
        return streams
    ready, _ = ray.wait(streams, num_returns=len(streams), timeout=0)
    ended = set()
    for stream in ready:
        try:
            next(stream)
        except Exception:  # StopIteration (it returned), or its actor is gone: nothing more to release
            ended.add(id(stream))
    return [stream for stream in streams if id(stream) not in ended]


def _original(error: RayTaskError) -> BaseException:
    """The exception the actor raised, with its original type and message.

    One that only crossed Ray by value (a class defined in a function or a notebook cell, an attribute
    holding a lambda) cannot reach the error channel, which pickles by reference: it becomes an
    ``OnlineDataWorkerError`` naming its type and message, with the actor's traceback.
    """
    cause = getattr(error, "cause", None)
    traceback_text = getattr(error, "traceback_str", "")
    if not isinstance(cause, BaseException) or isinstance(cause, RayTaskError):
        try:
            # a class Ray makes on the fly (RayTaskError(X)): sent as an OnlineDataWorkerError naming X
            return _sendable(error.as_instanceof_cause(), traceback_text)
        except Exception:
            return _sendable(error, traceback_text)
    return _sendable(cause, traceback_text)


def _sendable(error: BaseException, traceback_text: str) -> BaseException:
    """``error`` as the error channel can send it: the script's own class again (:func:`_as_main_class`),
    or, if it still cannot be pickled by reference, an ``OnlineDataWorkerError`` naming its type and
    message, with the actor's traceback."""
    error = _as_main_class(error)
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return unsendable_error(error, traceback_text)
    return error


def _as_main_class(error: BaseException) -> BaseException:
    """``error`` as an instance of the user's script's own class when its class was defined there.

    Such a class crossed Ray by value, so here it is a copy that the error channel (plain pickle, by
    reference) could not send; the script's module, which this process imported too, holds the original.
    """
    kind = type(error)
    if kind.__module__ != "__main__":
        return error
    original = sys.modules.get("__main__")
    for part in kind.__qualname__.split("."):
        original = getattr(original, part, None)
    if original is kind or not (isinstance(original, type) and issubclass(original, BaseException)):
        return error
    try:
        constructor, args, *state = error.__reduce_ex__(2)
        if constructor is not kind:
            return error
        rebuilt = original(*args)
        if state and state[0]:
            rebuilt.__dict__.update(state[0])
    except Exception:  # a constructor that does not take its own args back: keep the copy
        return error
    rebuilt.__cause__, rebuilt.__context__ = error.__cause__, error.__context__
    return rebuilt.with_traceback(error.__traceback__)


def _describe(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:300] + " ..."
    return f"{type(error).__name__}: {text}"
