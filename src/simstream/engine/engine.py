"""``OnlineDataEngine``: producers write whole episodes into shared memory; trainers sample from it.

Data flows one way: source -> producer worker -> write window -> shared buffer + eligibility index ->
sampler -> batch. This module wires the components (:meth:`OnlineDataEngine.__init__`) and exposes the
sampling API; :mod:`simstream.engine.lifecycle` owns the processes.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import torch
from tensordict import TensorDict

from .._memory_order import require_ordered_memory
from .._sync import SharedFlag, SharedLock, process_state, with_deadline
from ..buffer.gate import RecordGate
from ..buffer.index import EPISODE, EligibilityIndex
from ..buffer.storage import TrajectoryStorage
from ..config import OnlineDataEngineCfg
from ..errors import DataBudgetExhaustedError, DataUnavailableError, OnlineDataWorkerError
from ..language import SharedLanguageRegistry
from ..sampling.sampler import WindowSampler
from ..workers.channel import ErrorChannel
from .lifecycle import EngineLifecycle
from .progress import ProducerProgress
from .shared import EngineShared
from .sizing import check_context_lengths, check_shared_memory
from .state import OnlineDataEngineState as State

__all__ = ["OnlineDataEngine"]

_CHUNK_MODES = ("episode", "segment", "boundary")


class OnlineDataEngine(EngineLifecycle):
    """Stream expert episodes from producer processes into a shared trajectory buffer and sample it.

    Owns: the shared buffer ``[buffer_size, T]`` (payload keys of the source plus derived metadata), the
    eligibility index, the language registry, the error channel and (in the owner) the producer processes.
    Every window a sampler returns lies in one published episode: fully valid frames, one continuity region,
    never a row a producer is writing. Batches are copies.

    Pickle the engine into ``DataLoader`` workers or other processes (fork, spawn or forkserver) to sample
    there; only the owner may ``start``/``stop``.

    Attributes:
        cfg: The validated config.
        run_id: A random 63-bit id of this engine, stamped on every published episode (``ods_run_id`` with
            ``include_provenance``, and every lifecycle record): ids from two engines never mix.
        shared_buffer: The whole shared buffer as a ``TensorDict`` ``[buffer_size, T]`` (payload and
            metadata keys), for inspection: rows change under the reader while producers run; sample
            with :meth:`sample_batch` for consistent copies.
        buffer_size: Rows of the buffer.

    Examples:
        >>> cfg = OnlineDataEngineCfg(source=my_source_spec, buffer_size=64)  # doctest: +SKIP
        >>> with OnlineDataEngine(cfg) as engine:  # doctest: +SKIP
        ...     batch = engine.sample_batch(batch_size=32, chunk_size=16)
        ...     batch["actions"].shape
        torch.Size([32, 16, 8])
    """

    def __init__(self, cfg: OnlineDataEngineCfg) -> None:
        self._owner_pid = os.getpid()
        self._lifecycle = threading.Condition(threading.RLock())
        self._stop_requested = False
        self._busy_thread: int | None = None
        """The thread inside start() or stop() (a signal handler's stop() there must not wait for it)."""
        self._launching = False
        """``start()`` is launching the workers (a ``stop()`` from another thread waits for that)."""
        self._cleanup_complete = False
        self._forced_shutdown = False
        self._supervisor = None
        self._ray_joining = None
        if not isinstance(cfg, OnlineDataEngineCfg):
            raise TypeError(f"OnlineDataEngine expects an OnlineDataEngineCfg, got {type(cfg).__name__}")
        layout = cfg.validate()
        require_ordered_memory("OnlineDataEngine")
        check_shared_memory(cfg, layout)  # before anything is allocated: a config /dev/shm cannot hold
        try:
            self._spec_bytes = pickle.dumps(cfg.source)
        except Exception as error:
            raise ValueError(
                f"OnlineDataEngineCfg.source must be picklable (workers rebuild it), got {error}"
            ) from error
        self.cfg = cfg
        self.run_id = uuid.uuid4().int & (2**63 - 1)
        self._num_envs = layout.num_envs
        ctx = EngineShared.context()
        # Wiring, one edge per line: storage <- writer (workers); index <- writer, -> sampler; language,
        # quota and lifecycle log <- writer; channel <- workers and supervisor, -> every reader.
        storage = TrajectoryStorage(layout, cfg.buffer_size, cfg.include_provenance)
        index = EligibilityIndex(cfg.buffer_size, layout.max_episode_steps)
        quota = None
        if cfg.episode_sample_budget is not None:
            from ..buffer.quota import EpisodeQuota

            quota = EpisodeQuota(
                cfg.buffer_size, cfg.episode_sample_budget, cfg.episode_sample_hard_limit, self.run_id, ctx
            )
        events = None
        if cfg.lifecycle_event_capacity:
            from ..buffer.events import LifecycleEventLog

            events = LifecycleEventLog(cfg.lifecycle_event_capacity, layout.max_episode_steps, ctx)
        self._shared = EngineShared(
            storage=storage,
            index=index,
            language=SharedLanguageRegistry(cfg.language_buffer_bytes, context=ctx),
            channel=ErrorChannel(ctx),
            progress=ProducerProgress(cfg.num_workers, ctx),
            publish_lock=SharedLock(),
            close_flag=SharedFlag(ctx),
            state_code=ctx.Value("i", State.CREATED.code, lock=False),
            quota=quota,
            events=events,
            run_id=self.run_id,
            max_generation_attempts=cfg.max_generation_attempts,
            check_unwritten_frames=cfg.check_unwritten_frames,
            record_gate=RecordGate(cfg.buffer_size, ctx),
        )
        self._sampler = WindowSampler(storage, index, quota)
        self.shared_buffer: TensorDict = storage.rows_view()
        self.buffer_size: int = cfg.buffer_size
        self.device = torch.device("cpu")
        self._refill_after = (
            cfg.refill_threshold * cfg.buffer_size if cfg.refill_policy == "sample_threshold" else None
        )

    # -- pickling into consumers ---------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_supervisor"] = None
        state["_ray_joining"] = None
        state["_lifecycle"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lifecycle = threading.Condition(threading.RLock())

    @property
    def max_episode_steps(self) -> int:
        """Row capacity T."""
        return self._shared.storage.max_steps

    @property
    def language_registry(self) -> SharedLanguageRegistry:
        """The shared registry behind ``task_index`` / ``subtask_index``."""
        return self._shared.language

    # -- sampling ------------------------------------------------------------------------------------
    def sample_batch(
        self,
        batch_size: int,
        chunk_size: int,
        sampling_mode: Literal["episode", "segment", "boundary"] = "episode",
        *,
        generator: torch.Generator | None = None,
        out: TensorDict | None = None,
        keys: str | Sequence[str | tuple[str, ...]] | None = None,
    ) -> TensorDict:
        """Sample ``batch_size`` chunks of ``chunk_size`` consecutive valid frames.

        A row (episode) is drawn uniformly among rows holding an eligible window, then a start uniformly
        among that row's eligible starts. ``episode`` windows may cross segments but never a continuity
        change; ``segment`` windows stay inside one accepted segment; ``boundary`` windows cross at least one
        boundary between accepted segments.

        When no window is eligible only because producers are rewriting the rows that hold them, or are
        about to (a refill requested before the call and not complete), the call waits for them (up to
        ``OnlineDataEngineCfg.sample_wait_timeout`` seconds, re-checking the producers before every retry),
        so a producer's error is raised instead of ``DataUnavailableError``.

        Args:
            batch_size: Chunks in the batch (drawn with replacement).
            chunk_size: Frames per chunk, ``1 <= chunk_size <= T``.
            sampling_mode: ``"episode"``, ``"segment"`` or ``"boundary"``.
            generator: Optional RNG for reproducible draws.
            out: Optional preallocated TensorDict ``[batch_size, chunk_size]`` (e.g. from a previous call)
                to copy into, avoiding a fresh allocation for large batches. Every copied key is checked
                before anything is written; extra keys are left alone.
            keys: Copy only these keys, plus ``valid`` (``None``: every key). A key is a TensorDict key
                (``"actions"``, ``("obs", "state")``; a group such as ``"obs"`` selects every key under
                it) or a field name (``"obs/state"``); pass one key or a list of keys (a nested key
                alone as a list, ``[("obs", "state")]``: a bare tuple of strings is refused as
                ambiguous). The gather reads nothing else, so one camera of three costs one camera's
                bytes. The batch holds the keys in the buffer's order.

        Returns:
            A TensorDict ``[batch_size, chunk_size]`` with the copied keys, owning its memory.

        Raises:
            ValueError: an argument is out of range, the batch needs more bytes than the machine's
                memory, an entry of ``keys`` is not a key, or a copied key of ``out`` is not a contiguous
                tensor of the buffer's dtype and shape ``[batch_size, chunk_size, *frame]``.
            KeyError: a key of ``keys`` names nothing in the buffer (the message lists the buffer's
                keys), or ``out`` has no tensor at a copied key. Nothing is copied.
            DataUnavailableError: no eligible window (producers keep running); after the bounded wait
                when rows were being written or a requested refill was under way.
            DataBudgetExhaustedError: the eligible episodes' quotas cannot supply the batch; nothing charged.
            RuntimeError: the engine is not READY, or a producer's original exception.
        """
        self._check_ready("sample_batch")
        steps = self.max_episode_steps
        batch_size, chunk_size = _count("batch_size", batch_size), _count("chunk_size", chunk_size)
        _check_generator(generator)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if chunk_size > steps:
            raise ValueError(f"chunk_size ({chunk_size}) exceeds max_episode_steps ({steps}).")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}.")
        if sampling_mode not in _CHUNK_MODES:
            raise ValueError(
                f"sampling_mode must be 'episode', 'segment', or 'boundary', got {sampling_mode!r}."
            )
        if sampling_mode == "boundary" and chunk_size < 2:
            raise ValueError(f"boundary sampling requires chunk_size >= 2. Got chunk_size={chunk_size}.")
        try:
            batch = self._sampler.sample_chunks(
                batch_size,
                chunk_size,
                sampling_mode,
                generator,
                out=out,
                keys=keys,
                check_failed=self._raise_if_failed,
                check_ready=partial(self._check_ready, "sample_batch"),
                wait_s=self.cfg.sample_wait_timeout,
                rewrite_pending=self._refill_pending(),
            )
        except (DataUnavailableError, DataBudgetExhaustedError) as error:
            self._raise_if_failed()
            self._check_workers_alive()
            self._explain_unavailable(error)
            raise
        self._shared.record_samples(batch_size, self._refill_after)
        return batch

    def sample_batch_with_context(
        self,
        batch_size: int,
        history_length: int,
        prediction_horizon: int,
        *,
        generator: torch.Generator | None = None,
        sampling_mode: Literal["episode", "segment"] = "episode",
        generations: tuple[int, ...] | None = None,
        keys: str | Sequence[str | tuple[str, ...]] | None = None,
    ) -> TensorDict:
        """Sample causal contexts: history up to an anchor frame and the future targets after it.

        Position ``history_length - 1`` is the anchor ("now"); earlier positions are history, later ones
        future. A context never crosses an invalid frame, a continuity change or (``segment`` mode) a segment
        boundary: such positions are padding, with zero payload, ``-1`` language/provenance ids and
        ``valid=False``. ``loss_mask`` is ``valid`` at the anchor and after it: use it for every loss.

        Args:
            batch_size: Contexts in the batch (drawn with replacement).
            history_length: Observation frames up to and including the anchor, in ``[1, T]``
                (``max_episode_steps``: a context never reaches past its row).
            prediction_horizon: Target frames from the anchor on, in ``[1, T]``.
            generator: Optional RNG for reproducible draws.
            sampling_mode: ``"episode"`` or ``"segment"`` (context inside one accepted segment).
            generations: Only anchors of these generations (needs ``include_provenance=True``).
            keys: Copy only these keys, plus ``valid`` and ``loss_mask``, as in :meth:`sample_batch`.

        Returns:
            A TensorDict ``[batch_size, history_length + prediction_horizon - 1]`` plus ``loss_mask``.

        Raises:
            ValueError, KeyError: bad arguments or ``keys``, as in :meth:`sample_batch`; nothing is copied.
            DataUnavailableError: no eligible anchor, after the same bounded wait as :meth:`sample_batch`.
            DataBudgetExhaustedError: with per-episode quotas, fewer units remain than contexts asked for
                (one unit per context); nothing is charged.
            RuntimeError: the engine is not ``READY``, or a producer failed (its original exception).
        """
        history_length, prediction_horizon = check_context_lengths(
            history_length, prediction_horizon, self.max_episode_steps
        )
        if sampling_mode not in ("episode", "segment"):
            raise ValueError(f"Context sampling_mode must be episode or segment, got {sampling_mode!r}")
        if generations is not None and (
            not isinstance(generations, tuple)
            or not generations
            or any(type(g) is not int or g < 1 for g in generations)
        ):
            raise ValueError(
                f"generations must be a nonempty tuple of positive integers, got {generations!r}"
            )
        self._check_ready("sample_batch")
        batch_size = _count("batch_size", batch_size)
        _check_generator(generator)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if generations is not None and not self.cfg.include_provenance:
            raise ValueError("Source has no generation metadata")
        try:
            batch = self._sampler.sample_contexts(
                batch_size,
                history_length,
                prediction_horizon,
                sampling_mode,
                generator,
                generations,
                check_failed=self._raise_if_failed,
                keys=keys,
                check_ready=partial(self._check_ready, "sample_batch"),
                wait_s=self.cfg.sample_wait_timeout,
                rewrite_pending=self._refill_pending(generations),
            )
        except (DataUnavailableError, DataBudgetExhaustedError) as error:
            self._raise_if_failed()
            self._check_workers_alive()
            self._explain_unavailable(error)
            raise
        self._shared.record_samples(batch_size, self._refill_after)
        return batch

    def resolve_language(self, batch: TensorDict) -> dict[str, object]:
        """Task and subtask strings of a sampled batch, nested like the batch (valid after ``stop()``).

        Padded context positions hold ``-1`` and raise ``ValueError``; select valid positions first.
        """
        if "task_index" not in batch or "subtask_index" not in batch:
            raise ValueError("Online batch has no task_index/subtask_index language fields")
        registry = self._shared.language
        return {
            "task": registry.resolve(batch.get("task_index"), kind="task"),
            "subtask": registry.resolve(batch.get("subtask_index"), kind="subtask"),
        }

    def _explain_unavailable(self, error: Exception) -> None:
        """Raise ``DataUnavailableError`` again saying why producers may be paused (a full lifecycle log
        that only this owner can drain), if they are."""
        paused = self._log_full() if isinstance(error, DataUnavailableError) else ""
        if paused:
            raise DataUnavailableError(f"{str(error).rstrip('.')}{paused}") from None

    def _refill_pending(self, generations: tuple[int, ...] | None = None) -> Callable[[], bool]:
        """For one sample call: whether rows are about to be rewritten by a refill requested before the
        call (of one of ``generations``, when given), so that finding nothing eligible is worth waiting
        for (within ``sample_wait_timeout``). Refills requested later do not extend the wait, and producers
        paused on a full lifecycle log, which only this owner's ``drain_lifecycle_events`` frees, are not
        about to rewrite anything."""
        progress = self._shared.progress
        target = progress.requested_generation
        wanted = None if generations is None else set(generations)

        def pending() -> bool:
            completed = progress.completed_generation
            if completed >= target or self._log_full():
                return False
            return wanted is None or any(completed < g <= target for g in wanted)

        return pending

    def _check_ready(self, operation: str) -> None:
        state = self.state  # read before the channel: a failure published in between is raised as itself
        self._raise_if_failed()
        if state is not State.READY:
            raise RuntimeError(
                f"OnlineDataEngine.{operation}() requires state READY; current state is {state.value}."
            )
        self._check_workers_alive()

    # -- refill --------------------------------------------------------------------------------------
    def request_refill(self) -> int:
        """Ask for a new generation (every row rewritten once); coalesces with an outstanding request.

        Returns:
            The generation number to pass to :meth:`wait_for_generation`.
        """
        self._require_owner("request_refill")
        self._check_ready("request_refill")
        return self._shared.request_generation(self.cfg.sample_wait_timeout)

    def wait_for_generation(self, generation: int, timeout: float = 300.0) -> None:
        """Block until ``generation`` is complete, a producer fails, or ``timeout`` seconds pass.

        Raises:
            ValueError: ``generation`` was never requested, or bad arguments.
            TimeoutError: the generation was not complete in time (producers keep running).
        """
        if type(generation) is not int or generation < 1:
            raise ValueError(
                f"generation must be a positive integer (wait_for_generation), got {generation!r}"
            )
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"timeout must be finite and positive (wait_for_generation, seconds), got {timeout!r}"
            )
        progress = self._shared.progress
        if generation > progress.requested_generation:
            raise ValueError("generation has not been requested")
        # woken at once by a completed generation, a producer's failure or (through the supervisor's
        # monitor) its death
        deadline = time.monotonic() + timeout
        check = partial(self._check_ready, "wait_for_generation")
        if not progress.wait_for_completed(generation, deadline, check):
            raise TimeoutError(
                f"ODS generation {generation} was not published in {timeout}s{self._log_full()}"
                f"{self._recorder_behind()}"
            )

    def _log_full(self) -> str:
        """Why producers are paused: a reservation in the lifecycle log waits for room that only
        :meth:`drain_lifecycle_events` frees; else ``""``."""
        events = self._shared.events
        if events is None:
            return ""
        wanted = events.waiting_for_room()
        if not wanted:
            return ""
        pending, reserved = events.fill_estimate()
        return (
            f"; the lifecycle log holds {pending} of its {events.capacity} records ({reserved} more "
            f"reserved) and a producer waits for room for {wanted}: producers wait for "
            "drain_lifecycle_events() (a refill writes up to two records per row it writes)"
        )

    def _recorder_behind(self) -> str:
        """Why producers may be paused: a recorder in ``"wait"`` mode that has not copied what they would
        overwrite; else ``""``."""
        gate = self._shared.record_gate
        uncopied = 0 if gate is None else gate.uncopied(self._shared.index.episode_id)
        if not uncopied:
            return ""
        return (
            f"; a LeRobotRecorder (on_full='wait') has not copied {uncopied} published episode(s), and "
            "producers wait for it before overwriting them: is it slow, or stopped?"
        )

    # -- status --------------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise a producer failure if there is one, else ``RuntimeError`` unless READY."""
        self._check_failed_state()
        self._check_ready("check_health")

    def _check_failed_state(self) -> None:
        state = self.state  # read before the channel, as in _check_ready
        if state is State.STOPPED:
            return
        self._raise_if_failed()
        if state is State.FAILED:
            raise OnlineDataWorkerError("OnlineDataEngine is FAILED without an error envelope")
        if state is State.READY:
            self._check_workers_alive()

    def get_stats(self) -> dict[str, object]:
        """Counters of production and sampling (no state check, no lock; cheap).

        ``producers`` holds one dict per producer worker: ``index``, ``pid``, ``alive``, ``episodes``
        (published), ``failed_episodes``, ``frames``, ``completed_generation``, ``restarts`` (actor
        restarts with the Ray backend, always 0 for local processes) and ``node_id`` (with the Ray backend
        the actor's node id in hex, known in the owner once the actor started; else ``None``).
        """
        values = self._shared.progress.snapshot()
        index = self._shared.index
        stable = index.stable_rows()
        return {
            "producers": self._producer_stats(),
            "requested_generation": values["requested_generation"],
            "completed_generation": values["completed_generation"],
            "successful_episodes": values["successful_episodes"],
            "failed_episodes": values["failed_episodes"],
            "generated_frames": values["generated_frames"],
            "production_seconds": values["production_ns"] / 1e9,
            "sampled_chunks": values["sampled_chunks"],
            "run_id": self.run_id,
            "valid_frames": int(index.valid_frames[stable].sum()),
        }

    def _producer_stats(self) -> list[dict[str, object]]:
        rows = self._shared.progress.producer_rows()
        supervisor = self._supervisor
        dead = {label for label, _ in supervisor.dead_workers()} if supervisor is not None else set()
        owner, closing = self._is_owner(), self._shared.close_flag.is_set()
        for row in rows:
            if self.cfg.backend is not None:  # a Ray actor: its pid may be another machine's; 0 while
                # a lost actor's replacement is placed and built
                running = self.state is State.READY and "ray-ingest" not in dead and row["pid"] != 0
            else:
                running = _pid_alive(row["pid"]) and f"producer-{row['index']}" not in dead
            row["alive"] = running and not closing and (owner or self.state is State.READY)
        return rows

    def get_flow_status(self) -> dict[str, int | None]:
        """Generations, episodes and (with quotas) the remaining and delivered chunk counts."""
        self.check_health()
        values = self._shared.progress.snapshot()
        status = {
            "requested_generation": values["requested_generation"],
            "completed_generation": values["completed_generation"],
            "successful_episodes": values["successful_episodes"],
            "unlocked_remaining_chunks": None,
            "total_delivered_chunks": None,
        }
        quota = self._shared.quota
        if quota is not None:
            with quota.lock.held(self._quota_lock_check()):
                status["unlocked_remaining_chunks"] = quota.unlocked_remaining(self._sampleable_rows())
                status["total_delivered_chunks"] = quota.total_delivered()
        return status

    def _quota_lock_check(self):
        """The quota lock's wait: ends on a failure, or once its holder was stopped (SIGSTOP) for
        ``sample_wait_timeout``; a live holder (a long batch copy) is waited for."""
        lock = self._shared.quota.lock
        return with_deadline(self._raise_if_failed, self.cfg.sample_wait_timeout, "The quota lock", lock)

    def get_sampling_budget_snapshot(self) -> dict[str, object]:
        """Per-episode quota table (published rows) and totals; raises if the engine FAILED."""
        if self.state is State.FAILED:
            self._raise_if_failed()
            raise OnlineDataWorkerError("OnlineDataEngine is FAILED without an error envelope")
        quota = self._shared.quota
        if quota is None:
            return {
                "enabled": False,
                "rows": [],
                "unlocked_remaining_chunks": None,
                "total_delivered_chunks": None,
                "clock_origin_monotonic_ns": None,
            }
        index = self._shared.index
        with quota.lock.held(self._quota_lock_check()):
            return {
                "enabled": True,
                "rows": quota.snapshot(~index.stable_rows()),
                "unlocked_remaining_chunks": quota.unlocked_remaining(self._sampleable_rows()),
                "total_delivered_chunks": quota.total_delivered(),
                "episode_sample_budget": self.cfg.episode_sample_budget,
                "episode_sample_hard_limit": self.cfg.episode_sample_hard_limit,
                "clock_origin_monotonic_ns": quota.clock_origin_monotonic_ns,
            }

    def _sampleable_rows(self) -> torch.Tensor:
        index = self._shared.index
        return index.stable_rows() & (index.longest_run[EPISODE] >= 1)

    def drain_lifecycle_events(self) -> list[dict]:
        """Pending ``published``/``evicted`` records in order (owner only); frees their log space."""
        self._require_owner("drain_lifecycle_events")
        events = self._shared.events
        if events is None:
            return []
        # a producer stopped (SIGSTOP) while it holds the log's lock is waited for this long, as for quotas
        lock, bound = events.lock, self.cfg.sample_wait_timeout
        return events.drain(with_deadline(self._raise_if_failed, bound, "The lifecycle log lock", lock))


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not reaped yet, does not)."""
    return process_state(pid) not in (None, "Z", "X")


def _check_generator(generator: object) -> None:
    """Draws come from ``torch.rand`` on the CPU: anything but a CPU ``torch.Generator`` or ``None`` failed
    there, with torch's message, which names no argument."""
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
    ):
        device = f" on {generator.device}" if isinstance(generator, torch.Generator) else ""
        raise ValueError(
            f"generator must be a torch.Generator on the CPU or None, got {generator!r}{device}."
        )


def _count(name: str, value: object) -> int:
    """``value`` as an ``int`` if it is an integer of any integral type (NumPy's too), else ``ValueError``."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)
