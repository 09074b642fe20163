"""``APPORunner``: asynchronous PPO on gymnasium MuJoCo tasks, on top of :class:`AsyncRunner`.

Data flow, one arrow per edge::

    learner --WeightBuffer (seqlocked: actor, critic, obs statistics, version)--> collector
    collector --RolloutRing (slot: T x N frames, seq, policy version)--> learner
    learner --TensorBoard scalars, history rows, checkpoints--> log_dir
"""

from __future__ import annotations

import logging
import numbers
import os
import pickle
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch

from .._files import write_whole
from .._memory_order import require_ordered_memory
from .._validation import require, require_int, require_number
from ..errors import CollectorDiedError
from ..workers.supervisor import ctrl_c_deferred
from .collector import (
    TIMING_KEYS,
    CollectorSpec,
    RolloutCollector,
    describe_env,
    ring_fields,
    run_appo_collector,
)
from .config import APPOConfig
from .learner import APPOLearner
from .model import packed_size
from .ring import READY, RolloutRing, TakenSlot
from .runner import _SPAWN, AsyncRunner, CloseReport
from .weights import WeightBuffer

__all__ = ["APPORunner"]

logger = logging.getLogger(__name__)


_CHECKPOINT_KEYS = (
    "learner",
    "policy_version",
    "iterations",
    "env_frames",
    "trained_frames",
    "config",
    "dims",
)
"""What :meth:`APPORunner.save_checkpoint` writes."""


class APPORunner(AsyncRunner):
    """Async PPO: a spawned collector steps ``num_envs`` environments while the learner updates.

    Modes (``APPOConfig.mode``): ``"async"`` (default); ``"sync"`` (the collector waits for each update:
    lock-step, policy lag 0); ``"serial"`` (collect then learn in this process; no subprocess, for debugging).

    Owns the learner, the ring and the weight buffer; ``history`` holds one metrics row per update and
    ``last_run_summary`` the outcome of the last :meth:`learn`.

    Examples:
        >>> cfg = APPOConfig(env_id="InvertedPendulum-v5", num_envs=8)   # doctest: +SKIP
        >>> with APPORunner(cfg) as runner:                             # doctest: +SKIP
        ...     summary = runner.learn(100, log_dir=None, target_return=900)
    """

    _collector_fn = staticmethod(run_appo_collector)

    def __init__(
        self, config: APPOConfig | None = None, *, device: str | None = None, resume: str | None = None
    ) -> None:
        self._start_error: BaseException | None = None
        """Why the collector could not be started (the runner is unusable then)."""
        self.config = config if config is not None else APPOConfig()
        super().__init__(self.config.runner, device=device, collector_device="cpu")
        self.obs_dim, self.act_dim = describe_env(self.config.env_id)
        self.learner: APPOLearner = self._build_learner()
        self.policy_version = 0
        self.iterations_done = 0
        self._updating = False
        self._untrained: tuple | None = None
        """A batch taken from the ring and not trained on yet (kept across a Ctrl-C)."""
        self.trained_frames = 0
        self._frames_before = 0  # env frames of earlier runs (resume)
        self._frames_at_learn = 0  # env_frames when the current (or last) learn() call began
        self.ring: RolloutRing | None = None
        self.weights: WeightBuffer | None = None
        self._serial: RolloutCollector | None = None
        self.history: list[dict[str, float]] = []
        self.last_run_summary: dict | None = None
        self._returns: deque[float] = deque(maxlen=self.config.stats_window)
        self._lengths: deque[float] = deque(maxlen=self.config.stats_window)
        self._best_return = float("-inf")
        self._check_ring_fits()
        if resume is not None:
            self.load_checkpoint(resume)

    def _check_ring_fits(self) -> None:
        """The rollout ring must fit the free shared memory, checked before anything is built: a ring too
        large failed in the first ``learn()``, with the allocator's message, after a run had begun."""
        from simstream.engine.sizing import free_shared_bytes

        cfg = self.config
        needed = RolloutRing.shared_bytes(ring_fields(self._spec()), cfg.num_slots)
        free = free_shared_bytes()
        if free is not None and needed > free:
            raise ValueError(
                f"APPOConfig: a rollout ring of num_slots={cfg.num_slots} rollouts of "
                f"num_envs={cfg.num_envs} "
                f"x steps_per_rollout={cfg.steps_per_rollout} frames needs {needed / 2**30:.1f} GiB of "
                f"shared memory, more than the {free / 2**30:.1f} GiB free in /dev/shm: lower num_envs, "
                "steps_per_rollout or num_slots"
            )

    # ------------------------------------------------------------------ extension points
    def _get_default_device(self) -> str:
        # Small MLPs train faster on the CPU than through kernel launches; pass device="cuda" to override.
        return "cpu"

    def _build_learner(self) -> APPOLearner:
        return APPOLearner(self.config, self.obs_dim, self.act_dim, self.device)

    def _collector_seed(self) -> int:
        """``config.seed`` for a new run; a resumed one gets a seed of its own, derived from both, or it
        would replay the first run's starting states and action noise."""
        if self.iterations_done == 0:
            return self.config.seed
        return int(np.random.SeedSequence([self.config.seed, self.iterations_done]).generate_state(1)[0])

    def _spec(self) -> CollectorSpec:
        cfg = self.config
        return CollectorSpec(
            env_id=cfg.env_id, num_envs=cfg.num_envs, steps=cfg.steps_per_rollout,
            seed=self._collector_seed(), obs_dim=self.obs_dim, act_dim=self.act_dim,
            hidden_sizes=tuple(cfg.hidden_sizes),
            init_log_std=cfg.init_log_std, gamma=cfg.gamma, reward_scale=cfg.reward_scale,
            normalize_obs=cfg.normalize_obs, sync=cfg.mode == "sync",
            refresh_each_step=cfg.weight_refresh == "step",
        )  # fmt: skip

    def _ensure_started(self, crash_dir: str | None) -> None:
        if self.ring is not None:
            if self._start_error is not None:  # no collector runs: waiting for rollouts would only time out
                raise RuntimeError(
                    f"{type(self).__name__}: its collector failed to start "
                    f"({type(self._start_error).__name__}: {self._start_error}); close() this runner and "
                    "make a new one"
                ) from self._start_error
            return
        cfg, spec = self.config, self._spec()
        if cfg.mode != "serial":  # the collector copies the weights without a lock, in another process
            require_ordered_memory(f"APPORunner (mode={cfg.mode!r})")
        # A collector that failed to start, or shared memory that could not be set up for it (/dev/shm
        # full, a Ctrl-C meanwhile): later calls say so at once instead of waiting for rollouts.
        try:
            # Shared memory is allocated once, here in the owner, and registered for release by close().
            ring = RolloutRing(ring_fields(spec), cfg.num_slots, cfg.overflow, _SPAWN)
            self.ring = self._register_shared(ring)
            self.weights = self._register_shared(WeightBuffer(packed_size(self.learner.model, self.obs_dim)))
            self.weights.publish(self.learner.snapshot(), self.policy_version)
            if cfg.mode == "serial":
                self._serial = self._register_shared(
                    RolloutCollector(spec, self.ring, self.weights, in_learner=True)
                )
            else:
                self._start_collector(
                    {"spec": spec, "ring": self.ring, "weights": self.weights}, crash_dir=crash_dir
                )
        except BaseException as error:
            self._start_error = error
            raise

    # ------------------------------------------------------------------ training loop
    def learn(
        self,
        max_iterations: int,
        save_interval: int = 50,
        log_dir: str | None = "logs",
        *,
        max_env_frames: int | None = None,
        target_return: float | None = None,
        max_wall_s: float | None = None,
        callback: Callable[[dict[str, float]], None] | None = None,
    ) -> dict:
        """Run up to ``max_iterations`` updates; stop early at ``max_env_frames`` or ``target_return``.

        Args:
            max_iterations: Updates to run (>= 1).
            save_interval: Save ``model_<iteration>.pt`` into ``log_dir`` every this many updates; 0 saves
                no periodic checkpoints (the last update's is still saved).
            log_dir: TensorBoard logs, checkpoints and the collector crash log; ``None`` writes nothing.
            max_env_frames: Stop once the collector has stepped this many frames in total.
            target_return: Stop once the mean return of the last ``stats_window`` episodes reaches it.
            max_wall_s: Stop after the update that ends past this many seconds since ``learn`` began.
            callback: Called with each history row (the CLI's progress bar).

        Returns:
            ``last_run_summary``. :meth:`close` later adds ``close_errors`` to this same dict: the
            resources that could not be released (``None`` until the runner is closed).

        Raises:
            CollectorDiedError: the collector died, failed or hung (the summary is written first).
            KeyboardInterrupt: Ctrl-C; the summary's status is ``"interrupted"`` and, with ``log_dir``, the
                model as it was is saved first (``model_<updates done>.pt``, the summary's checkpoint).
        """
        require_int("APPORunner.learn", "max_iterations", max_iterations, 1)
        require_int("APPORunner.learn", "save_interval", save_interval, 0)
        if max_env_frames is not None:  # 2e5 and NumPy ints are frame counts too
            whole = isinstance(max_env_frames, numbers.Integral) or (
                isinstance(max_env_frames, float) and max_env_frames.is_integer()
            )
            require(
                whole and not isinstance(max_env_frames, bool) and max_env_frames >= 1,
                "APPORunner.learn",
                "max_env_frames",
                "None or a whole number >= 1",
                max_env_frames,
            )
            max_env_frames = int(max_env_frames)
        require_number("APPORunner.learn", "target_return", target_return, optional=True)
        require_number("APPORunner.learn", "max_wall_s", max_wall_s, 0, low_open=True, optional=True)
        self._raise_if_closed()
        threads = torch.get_num_threads()
        if self.config.learner_num_threads:
            torch.set_num_threads(self.config.learner_num_threads)
        writer = _tensorboard(log_dir)
        started, status, failure, checkpoint = time.monotonic(), "running", None, None
        self._frames_at_learn = self.env_frames  # rates count this call's frames, not a resumed run's
        self._updating = False
        try:
            self._ensure_started(log_dir)
            for _ in range(max_iterations):
                try:
                    row = self._iterate(started)
                except TimeoutError:  # the ring's lock, say, held by a collector that died holding it
                    self.check_collector()
                    raise
                if writer is not None:
                    for key, value in row.items():
                        writer.add_scalar(key, value, int(row["rl/env_frames"]))
                if callback is not None:
                    callback(row)
                if log_dir is not None and save_interval and self.iterations_done % save_interval == 0:
                    checkpoint = self.save_checkpoint(
                        os.path.join(log_dir, f"model_{self.iterations_done}.pt")
                    )
                if self._should_stop(row, max_env_frames, target_return, max_wall_s):
                    break
            status = "completed"
            if log_dir is not None:
                checkpoint = self.save_checkpoint(os.path.join(log_dir, f"model_{self.iterations_done}.pt"))
        except CollectorDiedError as error:
            status, failure = "collector_died", error.report
            raise
        except KeyboardInterrupt:
            # Ctrl-C: what was learned so far is saved, as at the end of a run (a resume continues it);
            # an update holds a Ctrl-C back until it is counted (off the main thread, where nothing can
            # be held back, one cut short is not saved: its model is half-way between two versions)
            status = "interrupted"
            if log_dir is not None and self.iterations_done > 0 and not self._updating:
                try:
                    checkpoint = self.save_checkpoint(
                        os.path.join(log_dir, f"model_{self.iterations_done}.pt")
                    )
                except Exception as error:  # the Ctrl-C is what the caller must see
                    logger.warning("saving the interrupted run's checkpoint failed: %s", error)
            raise
        except BaseException as error:
            status, failure = "failed", f"{type(error).__name__}: {error}"
            raise
        finally:
            torch.set_num_threads(threads)
            if writer is not None:
                writer.close()
            self.last_run_summary = self._summary(status, time.monotonic() - started, checkpoint, failure)
        return self.last_run_summary

    def _iterate(self, started: float) -> dict[str, float]:
        waited = time.perf_counter()
        taken, batch, episodes, timing, versions = self._next_batch()
        updated = time.perf_counter()
        lags = (self.policy_version - versions).flatten().tolist()
        # A Ctrl-C waits for the update, its publication and its count (the update's steps): landing
        # inside, it left a model half-way between two versions that no checkpoint could label, and a sync
        # collector waiting for a version that was never published, so every later learn() timed out. The
        # bookkeeping that follows (microseconds) is held back too: a run interrupted there reported an
        # update saved but no frame trained and no history row.
        with ctrl_c_deferred():
            self._updating = True  # until the update is counted: a checkpoint now would mislabel the model
            try:
                metrics = self.learner.update(batch)
            finally:
                self._untrained = None  # trained on (or its update failed: it is not tried again)
                # published even after a failed update: the learner's weights are the current policy
                # either way, and a sync collector waits for a newer version before its next rollout
                self.policy_version += 1
                self.weights.publish(self.learner.snapshot(), self.policy_version)
            self.iterations_done += 1
            self._updating = False
            timing["learner/update_s"] = time.perf_counter() - updated
            timing["learner/wait_s"] = updated - waited
            self.trained_frames += batch["rewards"].numel()
            for ret, length in episodes:
                self._returns.append(ret)
                self._lengths.append(length)
            ring = self.ring.stats()
            wall = time.monotonic() - started
            row = {
                "rl/iteration": float(self.iterations_done),
                "rl/wall_s": wall,
                "rl/env_frames": float(self.env_frames),
                "rl/env_frames_per_s": (self.env_frames - self._frames_at_learn) / max(wall, 1e-9),
                "rl/trained_frames": float(self.trained_frames),
                "rl/return": self.mean_return,
                "rl/episode_length": sum(self._lengths) / len(self._lengths)
                if self._lengths
                else float("nan"),
                "rl/episodes_in_window": float(len(self._returns)),
                "rl/policy_lag": sum(lags) / len(lags),
                "rl/policy_lag_max": float(max(lags)),
                "rl/rollouts_per_update": float(len(taken)),
                "ring/dropped_overflow": float(ring.dropped_overflow),
                "ring/dropped_stale": float(ring.dropped_stale),
                **metrics,
                **timing,
            }
            if row["rl/episodes_in_window"] >= self.config.stats_window:
                self._best_return = max(self._best_return, row["rl/return"])
            self.history.append(row)
        return row

    def _next_batch(
        self,
    ) -> tuple[list[TakenSlot], dict, list[tuple[float, float]], dict[str, float], torch.Tensor]:
        if self._untrained is not None:  # taken by a learn() that a Ctrl-C ended before its update
            return self._untrained
        cfg, ring = self.config, self.ring
        # a rollout left READY by a Ctrl-C after its commit is trained on first: collecting another one
        # beside it kept serial mode a rollout behind, at policy lag 1, for the rest of the run
        if self._serial is not None and READY not in ring.states():
            self._serial.pull_weights(lambda: False, -1)
            self._serial.collect(self._no_free_slot_within(self.runner_config.data_timeout_s))
        max_count = cfg.num_slots if cfg.mode == "async" else 1
        # the cap is async mode's: a sync or serial collector makes its next rollout only once this one is
        # trained on, so a rollout dropped there (one that straddled a load_checkpoint) stalled both sides
        capped = cfg.max_policy_lag is not None and cfg.mode == "async"
        min_version = self.policy_version - cfg.max_policy_lag if capped else None
        # sync mode, after a load_checkpoint: a rollout made wholly with the replaced weights is dropped
        # (trained on, it kept the collector a rollout ahead, at lag 1 for the rest of the run; its
        # collector already waits for a version older than the current one). One that took the loaded
        # weights mid-way is trained on: its collector waits for a version only this update publishes.
        newest_at_least = self.policy_version if cfg.mode == "sync" else None

        def poll(slice_s: float) -> tuple | None:
            # Taking slots, copying them out, giving them back and keeping the batch until its update are
            # one step for a Ctrl-C (it lands before or after; the copy takes milliseconds): landing in
            # between, it lost the rollout, and a sync collector then waited forever for a newer version.
            with ctrl_c_deferred():
                taken = ring.take(max_count, min_version, self.check_collector, newest_at_least)
                if taken:
                    try:
                        data = ring.gather(taken)
                    finally:
                        ring.free(taken)
                    self._untrained = (taken, *_batch_of(data))
                    return self._untrained
            ring.wait_filled(slice_s)
            return None

        return self._wait_until(poll, self.runner_config.data_timeout_s, "rollout")

    def _no_free_slot_within(self, timeout_s: float) -> Callable[[], bool]:
        """The serial collector's stop check: never stop, but raise past ``timeout_s`` (a rollout that
        cannot get a slot would otherwise wait forever: nothing else in this process frees one)."""
        deadline = time.monotonic() + timeout_s

        def check() -> bool:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"APPORunner: no rollout within {timeout_s} s in serial mode "
                    f"(ring slot states {self.ring.states()}; 0 free, 1 writing, 2 ready, 3 reading)"
                )
            return False

        return check

    def _should_stop(
        self, row: dict, max_env_frames: int | None, target_return: float | None, max_wall_s: float | None
    ) -> bool:
        if max_env_frames is not None and row["rl/env_frames"] >= max_env_frames:
            return True
        if max_wall_s is not None and row["rl/wall_s"] >= max_wall_s:
            return True
        return (
            target_return is not None
            and row["rl/episodes_in_window"] >= self.config.stats_window
            and row["rl/return"] >= target_return
        )

    def close(self) -> CloseReport:
        """:meth:`AsyncRunner.close`; also copies the report's ``errors`` to ``last_run_summary``."""
        with ctrl_c_deferred():  # the base class's held Ctrl-C would land before the copy
            report = super().close()
            if self.last_run_summary is not None:
                self.last_run_summary["close_errors"] = list(report.errors)
        return report

    # ------------------------------------------------------------------ state
    @property
    def env_frames(self) -> int:
        """Environment frames the collector has stepped (committed rollouts), including earlier runs."""
        committed = 0 if self.ring is None else self.ring.stats().committed
        return self._frames_before + committed * self.config.frames_per_rollout

    @property
    def mean_return(self) -> float:
        """Mean return of the last ``stats_window`` completed episodes (NaN before the first)."""
        return sum(self._returns) / len(self._returns) if self._returns else float("nan")

    def save_checkpoint(self, path: str) -> str:
        """Save model, target network, optimiser, normaliser, versions and config to ``path``."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = {
            "learner": self.learner.state_dict(),
            "policy_version": self.policy_version,
            "iterations": self.iterations_done,
            "env_frames": self.env_frames,
            "trained_frames": self.trained_frames,
            "config": asdict(self.config),
            "dims": (self.obs_dim, self.act_dim),
        }
        write_whole(path, lambda partial: torch.save(state, partial))  # never a torn file
        return path

    def load_checkpoint(self, path: str) -> None:
        """Restore a :meth:`save_checkpoint` file, target network included; the collector gets the weights.

        On a runner whose collector already runs, the restored weights get the next policy version, not
        the saved one: versions only increase, or a sync collector would wait for a newer one forever. In
        sync mode the next update drops a rollout made wholly with the replaced weights (``dropped_stale``)
        and trains on one made with the restored weights, at lag 0.

        Raises:
            ValueError: ``path`` is not a checkpoint of this runner, or was trained on another ``env_id``,
                with other dimensions, network sizes or observation normalisation (naming the difference).
        """
        self._raise_if_closed()
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except OSError as error:  # a checkpoint that cannot be read (permissions, I/O): say why
            raise ValueError(f"{path} cannot be read: {error.strerror or error}") from error
        except (RuntimeError, pickle.UnpicklingError, EOFError) as error:
            # torch's own text suggests weights_only=False: unsafe for a file that is not ours
            raise ValueError(
                f"{path} is not a checkpoint torch.load can read ({type(error).__name__})"
            ) from error
        missing = [key for key in _CHECKPOINT_KEYS if not isinstance(state, dict) or key not in state]
        if missing:
            raise ValueError(f"{path} is not an APPORunner checkpoint: it has no {missing}")
        if tuple(state["dims"]) != (self.obs_dim, self.act_dim):
            raise ValueError(
                f"checkpoint {path} has (obs_dim, act_dim) = {tuple(state['dims'])}, "
                f"{self.config.env_id} has {(self.obs_dim, self.act_dim)}"
            )
        saved_env = state["config"].get("env_id")
        if saved_env != self.config.env_id:  # same dimensions, another task: a resume would continue nothing
            raise ValueError(
                f"checkpoint {path} was trained on env_id={saved_env!r}; this runner has "
                f"env_id={self.config.env_id!r}: a resumed run continues training on the checkpoint's task"
            )
        for name in ("hidden_sizes", "normalize_obs"):  # what the collector builds its own policy from
            saved, current = state["config"].get(name), getattr(self.config, name)
            if (tuple(saved) if name == "hidden_sizes" else saved) != current:
                raise ValueError(
                    f"checkpoint {path} was trained with {name}={saved!r}; this runner has "
                    f"{name}={current!r} (the learner would restore the checkpoint's, the collector build "
                    "this one's): pass the checkpoint's value"
                )
        counts = {}
        for key in ("policy_version", "iterations", "trained_frames", "env_frames"):
            try:
                counts[key] = int(state[key])
            except (TypeError, ValueError, OverflowError) as error:
                raise ValueError(f"{path}: its {key} is not an integer ({state[key]!r})") from error
        # all or nothing for a Ctrl-C: a publish cut short left the collector a half-written policy (it
        # gave up reading it after 5 s and died), a load cut short a model no counter described
        with ctrl_c_deferred():
            try:
                self.learner.load_state_dict(state["learner"])  # all or nothing too
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as error:
                raise ValueError(
                    f"{path}: its learner state cannot be restored ({type(error).__name__}: {error}); "
                    "the runner is unchanged"
                ) from error
            # a batch a Ctrl-C left taken holds the replaced policy's rollout (and its log-probabilities):
            # trained after the load, it pushed out the collector's rollout made with the loaded weights
            self._untrained = None
            restored = counts["policy_version"]
            self.policy_version = restored if self.weights is None else max(restored, self.policy_version + 1)
            self.iterations_done = counts["iterations"]
            self.trained_frames = counts["trained_frames"]
            committed = 0 if self.ring is None else self.ring.stats().committed
            self._frames_before = counts["env_frames"] - committed * self.config.frames_per_rollout
            if self.weights is not None:
                self.weights.publish(self.learner.snapshot(), self.policy_version)

    def _summary(self, status: str, wall_s: float, checkpoint: str | None, failure: str | None) -> dict:
        ring = self.ring.stats() if self.ring is not None else None
        lags = [row["rl/policy_lag"] for row in self.history]
        return {
            "status": status,
            "env_id": self.config.env_id,
            "mode": self.config.mode,
            "iterations": self.iterations_done,
            "policy_version": self.policy_version,
            "env_frames": self.env_frames,
            "trained_frames": self.trained_frames,
            "wall_time_s": round(wall_s, 3),
            "env_frames_per_s": (
                round((self.env_frames - self._frames_at_learn) / wall_s, 1) if wall_s > 0 else None
            ),
            "final_return": None if not self._returns else self.mean_return,
            "best_return": None if self._best_return == float("-inf") else self._best_return,
            "mean_episode_length": (sum(self._lengths) / len(self._lengths)) if self._lengths else None,
            "mean_policy_lag": (sum(lags) / len(lags)) if lags else None,
            "dropped_overflow": ring.dropped_overflow if ring else 0,
            "dropped_stale": ring.dropped_stale if ring else 0,
            "last_checkpoint": checkpoint,
            "failure": failure,
            "close_errors": None if self.last_close_report is None else list(self.last_close_report.errors),
        }


def _batch_of(
    data: dict[str, torch.Tensor],
) -> tuple[dict, list[tuple[float, float]], dict[str, float], torch.Tensor]:
    """The learner's batch (env-major), the finished episodes' (return, length), the collector's mean
    timings and the per-step policy versions of rollouts copied out of the ring."""
    keys = ("obs", "actions", "logp", "rewards", "dones", "truncated", "final_obs")
    batch = {key: _env_major(data[key]) for key in keys}
    batch["last_obs"] = data["last_obs"].flatten(0, 1)
    episodes = []
    for i, count in enumerate(data["num_episodes"].tolist()):
        episodes += zip(
            data["episode_returns"][i, :count].tolist(), data["episode_lengths"][i, :count].tolist()
        )
    timing = dict(zip(TIMING_KEYS, data["timing_s"].mean(0).tolist()))
    return batch, episodes, timing, data["versions"]


def _env_major(stacked: torch.Tensor) -> torch.Tensor:
    """``[slots, T, N, ...]`` -> ``[T, slots * N, ...]`` (rollouts side by side along the env axis)."""
    return stacked.transpose(0, 1).flatten(1, 2)


def _tensorboard(log_dir: str | None):
    if log_dir is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir)
