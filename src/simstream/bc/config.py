"""``DemoConfig``: every setting of the streaming behaviour-cloning demo (``simstream demo``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .._validation import require, require_int, require_number
from ..config import INT64_MAX
from .evaluate import RolloutConfig
from .policy import PolicyConfig

__all__ = ["QUICK_OVERRIDES", "DemoConfig"]


@dataclass(frozen=True)
class DemoConfig:
    """Stream expert episodes into a live behaviour-cloning run, evaluate the policy, write a report.

    The defaults reach the issue's target on 2 CPU cores (two producers and the trainer share them);
    ``--quick`` shrinks every stage so the whole pipeline runs in well under 3 minutes.
    """

    quick: bool = False
    """Marks a smoke-test run (CI). ``--quick`` (in Python: ``DemoConfig().with_quick()``) applies the preset,
    few steps, small buffer, few evaluation episodes, and other flags still apply; this field alone changes
    nothing else."""
    name: str | None = None
    """Run name: results go to ``<runs-dir>/<name>/``. Default: ``demo-<date>-<time>``."""
    runs_dir: Path = Path("runs")
    """Parent folder of the run folders."""
    task: str = "pick_place"
    """Built-in task to stream and evaluate (``simstream.tasks.list_tasks()``)."""
    seed: int = 0
    """Seed of the producers, the sampler and the policy's initial weights."""

    # streaming
    buffer_size: int = 256
    """Episodes held in the shared buffer (one generation)."""
    num_workers: int = 2
    """Producer processes running the simulator and the scripted expert."""
    refill_threshold: int = 0
    """New generation after ``refill_threshold * buffer_size`` sampled contexts; 0 refills continuously."""
    backend: Literal["local", "ray"] = "local"
    """Where producers run: ``local`` processes, or ``ray`` actors anywhere in a Ray cluster
    (``docs/scale-out.md``)."""
    ray_address: str | None = None
    """With ``--backend ray``: the cluster to join (``auto``, ``host:port``); default: the one in
    ``RAY_ADDRESS``, else a Ray instance started on this machine."""
    record: Path | None = None
    """Record the live stream into this LeRobot v3.0 dataset while training (``docs/lerobot.md``)."""
    dataset: Path | None = None
    """Train from this LeRobot v3.0 dataset, replayed through the engine, instead of live simulation."""

    # training
    steps: int = 12000
    """Gradient steps."""
    batch_size: int = 256
    """Contexts per gradient step."""
    lr: float = 1e-3
    """Peak learning rate (one-cycle schedule: short warm-up, cosine decay)."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    history: int = 1
    """Observation frames the policy sees, up to and including "now"."""
    horizon: int = 16
    """Actions predicted per call (the chunk)."""
    hidden: int = 256
    """Width of the policy's hidden layers."""
    layers: int = 3
    """Hidden layers of the policy."""
    text_dim: int = 64
    """Width of the hashed bag-of-words instruction embedding."""
    num_threads: int = 1
    """Torch threads of the trainer. Keep 1 when producers share the cores: measured on 2 cores with 2
    producers, 1 thread trained at 34.5 steps/s, 2 threads at 2.7 steps/s (they wait for a core)."""
    time_limit_s: float = 720.0
    """Stop training early once this many seconds have passed since the start (keeps the demo bounded
    on slow machines); the summary records whether it happened."""

    # evaluation
    ensemble_decay: float | None = 0.0
    """Temporal ensembling: every step blends all chunks that cover it, weights ``exp(-m * i)`` from the
    oldest (``i = 0``); 0 averages. ``None`` executes ``execute_steps`` of each chunk and replans instead."""
    execute_steps: int = 8
    """Actions executed from each predicted chunk before replanning (with ``ensemble_decay None``)."""
    eval_every: int = 2000
    """Gradient steps between the closed-loop checks that trace success over training."""
    eval_episodes_during: int = 20
    """Episodes per check during training."""
    eval_episodes: int = 50
    """Seeded episodes of the final evaluation."""
    max_episode_steps: int = 200
    """Truncation of evaluation episodes (and the producers' row capacity), at least 100 (20 Hz)."""

    def __post_init__(self) -> None:
        positive = (
            "buffer_size", "num_workers", "steps", "batch_size", "num_threads", "eval_every",
            "eval_episodes",
        )  # fmt: skip
        for name in positive:
            require_int("DemoConfig", name, getattr(self, name), 1)
        # the scripted experts take up to ~80 steps (150 seeds per task); shorter rows cannot hold a success
        require_int("DemoConfig", "max_episode_steps", self.max_episode_steps, 100)
        for name in ("refill_threshold", "eval_episodes_during"):
            require_int("DemoConfig", name, getattr(self, name), 0)
        require_int("DemoConfig", "seed", self.seed, 0, INT64_MAX)
        self.engine_backend  # noqa: B018  (validates backend and ray_address)
        for name in ("lr", "time_limit_s"):
            require_number("DemoConfig", name, getattr(self, name), 0, low_open=True)
        require_number("DemoConfig", "weight_decay", self.weight_decay, 0)
        require(
            self.buffer_size >= self.num_workers,
            "DemoConfig",
            "buffer_size",
            f">= num_workers ({self.num_workers})",
            self.buffer_size,
        )
        require(
            self.name is None or (bool(self.name) and "/" not in self.name and self.name not in (".", "..")),
            "DemoConfig",
            "name",
            "a folder name without '/'",
            self.name,
        )
        from simstream.tasks import get_task

        get_task(self.task)
        self.policy_config  # noqa: B018  (validates the policy fields)
        self.rollout_config  # noqa: B018

    @property
    def engine_backend(self):
        """The engine's ``backend``: ``None`` (local processes) or a :class:`simstream.ray.RayBackend`."""
        from simstream.ray.backend import backend_from_flags

        return backend_from_flags("DemoConfig", self.backend, self.ray_address)

    @property
    def policy_config(self) -> PolicyConfig:
        """The policy's shape."""
        return PolicyConfig(
            history=self.history,
            horizon=self.horizon,
            hidden=self.hidden,
            layers=self.layers,
            text_dim=self.text_dim,
        )

    @property
    def rollout_config(self) -> RolloutConfig:
        """How evaluation executes the predicted chunks."""
        return RolloutConfig(
            execute_steps=self.execute_steps,
            ensemble_decay=self.ensemble_decay,
            max_episode_steps=self.max_episode_steps,
        )

    def with_quick(self) -> DemoConfig:
        """This config with :data:`QUICK_OVERRIDES` applied."""
        return dataclasses.replace(self, quick=True, **QUICK_OVERRIDES)


QUICK_OVERRIDES: dict[str, object] = {
    "buffer_size": 16,
    "steps": 150,
    "batch_size": 64,
    "eval_every": 75,
    "eval_episodes_during": 2,
    "eval_episodes": 4,
    "time_limit_s": 120.0,
}
"""What ``--quick`` changes: a pipeline smoke test, not a policy that succeeds."""
