"""``DemoConfig``: every setting of the streaming behaviour-cloning demo (``simstream demo``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .._runs import FOLDER_NAME_RULE, is_folder_name
from .._validation import MAX_TORCH_THREADS, require, require_default, require_int, require_number
from ..config import INT64_MAX
from .evaluate import RolloutConfig
from .policy import MAX_CONTEXT_STEPS, NETWORK_SIZE_BOUNDS, PolicyConfig
from .vision import MAX_CHANNELS, OBJECT_DIM, VisionPolicyConfig

__all__ = ["QUICK_OVERRIDES", "QUICK_VISION_OVERRIDES", "VISION_OVERRIDES", "DemoConfig"]


DURING_TRAINING_SEED_OFFSET = 10_000
"""Checks during training use ``eval_seeds(n, offset=10_000)``: disjoint from the final evaluation's
``[0, eval_episodes)``, which is at most this many."""


@dataclass(frozen=True)
class DemoConfig:
    """Stream expert episodes into a live behaviour-cloning run, evaluate the policy, write a report.

    The defaults reach the demo's target, 80% closed-loop success, on 2 CPU cores (two producers and the
    trainer share them);
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
    idle_threads: int = 0
    """Torch threads of the trainer while the producers are idle (their generation is complete and no
    refill is outstanding); 0: always ``num_threads``. With ``refill_threshold`` > 0 the producers work in
    bursts, and between them the trainer can use their cores as well. In [0, 256]."""
    time_limit_s: float = 720.0
    """Stop training early once this many seconds have passed since the start (keeps the demo bounded
    on slow machines); the summary records whether it happened."""

    # vision (``--vision``)
    vision: bool = False
    """Train a visuomotor policy from camera frames, proprioception and the instruction only (no object
    poses). ``--vision`` (in Python: ``DemoConfig().with_vision()``) also sets one producer, 128 episodes,
    30000 steps of 64, a 1440-s time limit, ``object_aux_weight=1``, ``object_input`` and
    ``ema_decay=0.9995`` (``VISION_OVERRIDES``); this field alone changes nothing else."""
    cameras: tuple[str, ...] = ("front", "wrist")
    """With ``--vision``: cameras the producers render into ``obs/images/<camera>`` and the policy reads."""
    image_size: int = 64
    """With ``--vision``: side of the square uint8 camera frames, in [16, 256]."""
    shift: int = 4
    """With ``--vision``: random-shift augmentation (DrQ) in pixels, in [0, image_size / 4]."""
    channels: int = 16
    """With ``--vision``: channels of each camera's conv encoder."""
    action_noise: float = 0.0
    """With ``--vision``: standard deviation (rad) of the Gaussian noise the producers add to the joint
    targets they execute, while the stream records the expert's own command (DART): the policy sees the
    expert correct perturbed states and retry missed grasps. In [0, 0.5]."""
    object_aux_weight: float = 0.0
    """With ``--vision``: weight of an auxiliary loss that predicts the cubes' positions from the camera
    features during training (0: none). The positions are a training target only, never an input of the
    policy; evaluation never reads them."""
    object_input: bool = False
    """With ``--vision`` and ``object_aux_weight`` > 0: the action head also reads the auxiliary head's
    estimate of the cube positions (made from the camera features, never from the simulator), their
    offsets from the gripper and the instructed cube's, as the state policy reads the true poses."""
    device: str = "cpu"
    """Trainer device: ``cpu``, or ``cuda`` / ``cuda:N`` when one is available (batches are pinned and
    copied with ``non_blocking``); producers always run on the CPU."""
    ema_decay: float = 0.0
    """Exponential moving average of the weights (as diffusion policy and robomimic keep one): after every
    step ``average = d * average + (1 - d) * weights`` with ``d = min(ema_decay, (1 + n) / (10 + n))`` after
    ``n`` steps (a warm-up, :func:`simstream.bc.train.weight_average`). The checks during training, the
    final evaluation and the checkpoint use the averaged weights; 0 uses the trained weights as they are.
    In [0, 1); about ``1 / (1 - ema_decay)`` recent steps carry most of the average."""
    precision: Literal["float32", "bfloat16", "auto"] = "float32"
    """Arithmetic of the training forward and backward passes: ``float32``, or ``bfloat16`` autocast (the
    weights, the optimiser and the loss stay float32; on a CPU it needs native bfloat16 instructions,
    AVX512-BF16 or AMX, and made vision steps about 1.25x faster here). ``auto``: ``bfloat16`` for a vision
    trainer where the CPU has them, else ``float32``. Evaluation always runs in float32. The default stays
    float32: the one full vision run with bfloat16 did not learn better for its extra steps
    (``docs/demo.md``)."""

    # evaluation
    ensemble_decay: float | None = 0.0
    """Temporal ensembling: every step blends all chunks that cover it, weights ``exp(-m * i)`` from the
    oldest (``i = 0``); 0 averages. ``None`` executes ``execute_steps`` of each chunk and replans instead."""
    execute_steps: int = 8
    """Actions executed from each predicted chunk before replanning (with ``ensemble_decay None``)."""
    gripper_threshold: float | None = 0.25
    """The executed gripper command is fully open above this and closed at or below it, like the expert's
    (``None``: the predicted value as it is). In (0, 1). A regressed value in between left vision policies
    holding the cube in the bin with the fingers half open (measured in ``docs/demo.md``)."""
    eval_every: int = 2000
    """Gradient steps between the closed-loop checks that trace success over training."""
    eval_episodes_during: int = 20
    """Episodes per check during training."""
    eval_episodes: int = 50
    """Seeded episodes of the final evaluation."""
    max_episode_steps: int = 200
    """Truncation of evaluation episodes (and the producers' row capacity), at least 100 (20 Hz)."""

    def __post_init__(self) -> None:
        positive = ("buffer_size", "num_workers", "steps", "batch_size", "eval_every")
        for name in positive:
            require_int("DemoConfig", name, getattr(self, name), 1)
        # the final evaluation's seeds are offsets [0, eval_episodes), the checks' start at the offset
        # below: more episodes would evaluate on seeds the checks during training had already run
        require_int("DemoConfig", "eval_episodes", self.eval_episodes, 1, DURING_TRAINING_SEED_OFFSET)
        require_int(
            "DemoConfig", "eval_episodes_during", self.eval_episodes_during, 0, DURING_TRAINING_SEED_OFFSET
        )
        require_int("DemoConfig", "num_threads", self.num_threads, 1, MAX_TORCH_THREADS)
        # the scripted experts take up to ~80 steps (150 seeds per task); shorter rows cannot hold a success
        require_int("DemoConfig", "max_episode_steps", self.max_episode_steps, 100)
        if self.record is not None and Path(self.record).is_file():
            raise ValueError(
                f"DemoConfig.record must be a dataset folder (new or to append to), got the file "
                f"{str(self.record)!r}"
            )
        if (
            self.record is not None
            and self.dataset is not None
            and Path(self.record).resolve() == Path(self.dataset).resolve()
        ):
            raise ValueError(
                f"DemoConfig.record must not be the dataset the demo replays ({str(self.dataset)!r}): the "
                "replayed episodes would be appended to it again and again; record into another folder"
            )
        for name in ("history", "horizon"):  # a context spans history + horizon - 1 frames of one row
            require_int(
                "DemoConfig", name, getattr(self, name), 1, min(self.max_episode_steps, MAX_CONTEXT_STEPS)
            )
        if self.ensemble_decay is None and type(self.execute_steps) is int:  # chunks hold horizon actions
            require_int("DemoConfig", "execute_steps", self.execute_steps, 1, self.horizon)
        elif type(self.execute_steps) is int and self.execute_steps >= 1:  # else RolloutConfig's message
            # accepted and ignored, it was recorded in summary.json and the checkpoint as if applied
            require_default(
                self, "DemoConfig", "execute_steps",
                f"with temporal ensembling (ensemble_decay={self.ensemble_decay!r}), which executes one "
                "action of every chunk",
                "Add --ensemble-decay None for chunk execution, or leave the option out",
            )  # fmt: skip
        require_int("DemoConfig", "refill_threshold", self.refill_threshold, 0)
        require_int("DemoConfig", "idle_threads", self.idle_threads, 0, MAX_TORCH_THREADS)
        require_int("DemoConfig", "seed", self.seed, 0, INT64_MAX)
        self.engine_backend  # noqa: B018  (validates backend and ray_address)
        for name in ("lr", "time_limit_s"):
            require_number("DemoConfig", name, getattr(self, name), 0, low_open=True)
        require_number("DemoConfig", "object_aux_weight", self.object_aux_weight, 0, 100)
        require(
            isinstance(self.object_input, bool), "DemoConfig", "object_input", "a bool", self.object_input
        )
        require(
            not self.object_input or self.object_aux_weight > 0,
            "DemoConfig", "object_input", "False when object_aux_weight is 0 (the estimate needs its loss)",
            self.object_input, "Pass --no-object-input (object_input=False) with --object-aux-weight 0",
        )  # fmt: skip
        require_number("DemoConfig", "action_noise", self.action_noise, 0, 0.5)
        require_number("DemoConfig", "weight_decay", self.weight_decay, 0)
        require_number("DemoConfig", "ema_decay", self.ema_decay, 0, 1, high_open=True)
        require(
            self.buffer_size >= self.num_workers,
            "DemoConfig",
            "buffer_size",
            f">= num_workers ({self.num_workers})",
            self.buffer_size,
        )
        require(
            self.name is None or is_folder_name(self.name),
            "DemoConfig",
            "name",
            FOLDER_NAME_RULE,
            self.name,
        )
        from simstream.tasks import get_task

        get_task(self.task)
        require_int("DemoConfig", "image_size", self.image_size, 16, 256)
        require_int("DemoConfig", "shift", self.shift, 0, self.image_size // 4)
        require_int("DemoConfig", "channels", self.channels, 8, MAX_CHANNELS)
        for name, low, high in NETWORK_SIZE_BOUNDS:  # named here: the flags are the demo's
            require_int("DemoConfig", name, getattr(self, name), low, high)
        self._check_cameras()
        self._check_vision_only()
        self._check_device()
        self.training_dtype  # noqa: B018  (validates precision)
        self.policy_config  # noqa: B018  (validates the policy fields)
        self.rollout_config  # noqa: B018

    @property
    def engine_backend(self):
        """The engine's ``backend``: ``None`` (local processes) or a :class:`simstream.ray.RayBackend`."""
        from simstream.ray.backend import backend_from_flags

        return backend_from_flags("DemoConfig", self.backend, self.ray_address)

    def _check_cameras(self) -> None:
        from simstream.tasks import CAMERAS

        cameras = self.cameras
        if isinstance(cameras, list):  # as VisionPolicyConfig takes them
            object.__setattr__(self, "cameras", cameras := tuple(cameras))
        require(
            isinstance(cameras, tuple) and bool(cameras) and set(cameras) <= set(CAMERAS)
            and len(set(cameras)) == len(cameras),
            "DemoConfig", "cameras", f"one or more distinct cameras of {CAMERAS}", cameras,
        )  # fmt: skip

    def _check_vision_only(self) -> None:
        """The camera policy's fields, changed without ``vision``, would be recorded in the run's summary
        as if they had been applied to the state policy they never reach."""
        if self.vision:
            return
        for name in _VISION_ONLY:
            require_default(
                self, "DemoConfig", name,
                "without --vision (vision=False): it applies to the camera policy only",
                "Add --vision, or leave the option out",
            )  # fmt: skip

    def _check_device(self) -> None:
        import torch

        device = self.device
        valid = isinstance(device, str) and (
            device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
        )
        require(valid, "DemoConfig", "device", "'cpu', 'cuda' or 'cuda:N'", device)
        if device != "cpu":
            index = int(device[5:]) if ":" in device else 0
            require(
                torch.cuda.is_available() and index < torch.cuda.device_count(),
                "DemoConfig", "device", f"an available device ({torch.cuda.device_count()} CUDA devices)",
                device, "Use --device cpu on a machine without a GPU",
            )  # fmt: skip

    @property
    def training_dtype(self):
        """The ``torch.dtype`` of the training passes that :attr:`precision` resolves to on this machine."""
        import torch

        require(
            self.precision in ("auto", "float32", "bfloat16"), "DemoConfig", "precision",
            "'float32', 'bfloat16' or 'auto'", self.precision,
        )  # fmt: skip
        native = self.device != "cpu" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.precision == "bfloat16":
            require(
                native, "DemoConfig", "precision", "'float32' or 'auto' on this CPU (no native bfloat16)",
                self.precision, "bfloat16 autocast without AVX512-BF16 or AMX is slower than float32",
            )  # fmt: skip
            return torch.bfloat16
        if self.precision == "auto" and self.vision and self.device == "cpu" and native:
            return torch.bfloat16
        return torch.float32

    @property
    def policy_config(self) -> PolicyConfig | VisionPolicyConfig:
        """The policy's shape: a :class:`VisionPolicyConfig` with ``vision``."""
        if self.vision:
            return VisionPolicyConfig(
                cameras=self.cameras, image_size=self.image_size, history=self.history, horizon=self.horizon,
                hidden=self.hidden, layers=self.layers, text_dim=self.text_dim, channels=self.channels,
                shift=self.shift, object_dim=OBJECT_DIM if self.object_aux_weight > 0 else 0,
                object_input=self.object_input,
            )  # fmt: skip
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
            gripper_threshold=self.gripper_threshold,
        )

    def with_quick(self) -> DemoConfig:
        """This config with :data:`QUICK_OVERRIDES` (and, with vision, :data:`QUICK_VISION_OVERRIDES`)."""
        vision = QUICK_VISION_OVERRIDES if self.vision else {}
        return dataclasses.replace(self, quick=True, **{**QUICK_OVERRIDES, **vision})

    def with_vision(self) -> DemoConfig:
        """This config with :data:`VISION_OVERRIDES` applied (``--vision``; before ``with_quick``)."""
        return dataclasses.replace(self, vision=True, **VISION_OVERRIDES)


_VISION_ONLY = (
    "cameras",
    "image_size",
    "shift",
    "channels",
    "action_noise",
    "object_aux_weight",
    "object_input",
)
"""Fields of the camera policy and its producers (``--vision``)."""

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

QUICK_VISION_OVERRIDES: dict[str, object] = {
    "buffer_size": 8,
    "steps": 60,
    "batch_size": 32,
    "eval_every": 30,
}
"""What ``--quick`` also changes with ``--vision``: conv steps cost ~10x an MLP step on the CPU."""

VISION_OVERRIDES: dict[str, object] = {
    "num_workers": 1,
    "buffer_size": 128,
    "steps": 30000,
    "batch_size": 64,
    "eval_every": 4000,
    "time_limit_s": 1440.0,
    "object_aux_weight": 1.0,
    "object_input": True,
    "ema_decay": 0.9995,
}
"""What ``--vision`` changes besides ``vision=True``: the conv trainer, not the producers, is the bottleneck
on 2 cores, so one producer renders while the trainer takes the other core; smaller batches, more steps
than 30 minutes hold on the 2-vCPU machines measured (11-20 steps/s), so that the time limit, which leaves
the final evaluation inside 30 minutes, ends training there (the learning rate anneals by time as well);
the auxiliary cube-position loss (a training target only, see :class:`simstream.bc.VisionPolicy`) and the
action head reading its estimate (``object_input``: 76-77% against 53-61% over 150 seeds,
``docs/demo.md``); an average of the weights (``ema_decay``; a small, uncertain gain in two runs). The
producer streams continuously:
bursts with the trainer on both cores between them (``refill_threshold=800``, ``idle_threads=2``) took
40% more steps from half the episodes and ended lower. Perturbed demonstrations (``action_noise``) stay
opt-in: their full run learned faster early but ended lower (``docs/demo.md``)."""
