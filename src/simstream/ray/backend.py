"""``RayBackend``: where and how the engine's producers run as Ray actors (configuration only, no ``ray``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Real

from .._validation import require, require_int, require_number

__all__ = [
    "MAX_CALLS_IN_FLIGHT",
    "MAX_RESTARTS",
    "RAY_LEAVE_S",
    "RayBackend",
    "RayProducerError",
    "backend_from_flags",
]

MAX_RESTARTS = 10_000
MAX_CALLS_IN_FLIGHT = 64
MAX_WINDOWS_PER_CALL = 1024
MAX_PUBLISH_DELAY_S = 10.0
MAX_ACTOR_CPUS = 1024
MAX_WAIT_S = 1e6
RESOURCE_UNIT = 1e-4
"""Ray's resource precision: a fractional amount below it is refused by Ray (``num_cpus`` may be 0)."""
_OWNER = "RayBackend"
_RESERVED_RESOURCES = frozenset(
    {"CPU", "memory", "GPU", "TPU", "NPU", "HPU", "neuron_cores", "RBLN", "MBLT", "FURIOSA", "TTNPU"}
)
"""Names Ray gives rules of its own (CPU and memory: ``num_cpus``; accelerators, as of Ray 2.60: whole or
fractional amounts per device kind); ``resources`` holds custom resources only."""


class _ReadOnlyDict(dict):
    """A mapping field of a validated :class:`RayBackend`: changes are refused (``TypeError`` naming the
    field), it pickles as a plain ``dict`` and hashes when its values do. Shallow: a nested mapping of
    ``runtime_env`` is the caller's own."""

    def __init__(self, items=(), field_name: str = "mapping") -> None:
        # (items) alone too: dataclasses.asdict rebuilds a dict subclass from its pairs
        super().__init__(items)
        self._field_name = field_name

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            f"{_OWNER}.{self._field_name} cannot be changed: the backend was validated with it; make another "
            f"with dataclasses.replace(backend, {self._field_name}=...)"
        )

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return dict, (dict(self),)

    def __hash__(self) -> int:
        return hash(frozenset(self.items()))


@dataclass(frozen=True)
class RayBackend:
    """Run ``OnlineDataEngineCfg.num_workers`` producers as Ray actors wherever the cluster places them.

    Each actor builds its source from the engine's ``SourceSpec``, rolls windows out into its own memory
    and returns them by value; the engine's ingest process on the trainer's machine claims, writes and
    publishes them into the shared buffer through the same write protocol as local producers. Every field
    is checked on construction (``ValueError`` naming the field and its accepted range), before anything
    connects to Ray.

    Examples:
        >>> backend = RayBackend(resources={"sim": 1}, max_restarts=3)
        >>> backend.calls_in_flight
        2
        >>> RayBackend(max_restarts=-1)
        Traceback (most recent call last):
        ...
        ValueError: RayBackend.max_restarts must be an int in [0, 10000], got -1
    """

    address: str | None = None
    """Ray cluster to join: ``None`` uses the current connection if there is one, else ``ray.init()``
    (which honours ``RAY_ADDRESS``); ``"auto"`` or ``"host:port"`` (the GCS address) joins a running
    cluster, ``"local"`` starts a private one. A Ray Client address (``ray://``) is refused: the ingest
    joins as a driver (a script connected through Ray Client may leave this ``None``)."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom resources every producer actor requires, e.g. ``{"sim": 1}`` to keep producers on the
    simulation machines (started with ``ray start --resources '{"sim": N}'``)."""
    max_restarts: int = 3
    """Restarts per producer after its actor process or node was lost, in ``[0, 10000]``; each restart
    builds a fresh source with a new seed and re-issues the windows that were in flight."""
    num_cpus: float = 1.0
    """CPUs each actor reserves from the cluster, in ``[0, 1024]`` (one simulation core by default)."""
    call_timeout_s: float = 300.0
    """Seconds one window may take on its actor (from the moment the ingest waits for it; an item of
    ``windows_per_call`` windows may take that many times as long), in ``(0, 1e6]``; past it the engine
    fails (a hang). An item that is finished but waits for the ingest (held up by back-pressure: a full
    lifecycle log, a recorder) never counts as a hang."""
    start_timeout_s: float = 600.0
    """Seconds an actor may take to be placed on a node, start and build its source, in ``(0, 1e6]``
    (a replacement waits here while its node is gone); past it the engine fails."""
    calls_in_flight: int = 2
    """Items (of ``windows_per_call`` windows each) one actor may have finished or be making that the
    ingest has not received yet, in ``[1, 64]``. The ingest asks an actor for a generation's windows with
    one streaming call, and Ray's back-pressure holds the actor at this bound: 2 keeps it busy while a
    finished item travels (1: it starts an item only once the last one was received). An actor works
    only on generations the engine requested, so idle producers stay idle."""
    windows_per_call: int = 1
    """Windows one item of an actor's stream carries, in ``[1, 1024]``. Each item costs the trainer a
    fixed amount of Ray overhead (about half a millisecond); raise it for sources whose windows take far
    less than that to simulate, so that one trainer absorbs more of them (``BENCHMARKS.md``)."""
    publish_windows: int = 32
    """Most windows of one producer the ingest publishes together, in ``[1, 1024]``: windows that arrived
    in consecutive items are claimed, written and published as one group (one claim, one lock hold, one
    lifecycle append), which costs the trainer a fraction of publishing them one by one (``BENCHMARKS.md``,
    run 8). The windows of one item always go together, so an item of more windows makes a larger group;
    1: every item's windows are published as they arrive."""
    publish_delay_s: float = 0.01
    """Longest a window that arrived waits for the windows after it, in ``[0, 10]`` seconds, before its
    group is published. A producer's last window of a generation is published at once, so refills and
    ``wait_for_generation`` are not delayed; 0: publish every item's windows as they arrive."""
    restart_delay_s: float = 1.0
    """Seconds between losing an actor and starting its replacement, in ``[0, 3600]``."""
    runtime_env: Mapping[str, object] | None = None
    """Ray runtime environment of the actors (``None``: the driver's); e.g. ``{"env_vars": {...}}``. Checked
    on construction by Ray's own ``RuntimeEnv`` (the one field whose check imports ``ray``)."""

    def __post_init__(self) -> None:
        self.validate()
        # read-only copies, so the config stays as validated (a change to the caller's dict, or to
        # backend.resources, reached Ray unchecked); they pickle as plain dicts into the ingest process,
        # which a MappingProxyType cannot
        object.__setattr__(self, "resources", _ReadOnlyDict(self.resources, "resources"))
        if self.runtime_env is not None:
            object.__setattr__(self, "runtime_env", _ReadOnlyDict(self.runtime_env, "runtime_env"))

    def validate(self) -> None:
        """Check every field.

        Raises:
            ValueError: naming the field and its accepted range.
        """
        require_ray_address(_OWNER, "address", self.address)
        resources = self.resources
        require(
            isinstance(resources, Mapping),
            _OWNER,
            "resources",
            "a mapping of resource name to amount",
            resources,
        )
        for name, amount in resources.items():
            require(
                isinstance(name, str) and name.strip() != "" and name not in _RESERVED_RESOURCES,
                _OWNER,
                "resources",
                "a mapping whose keys are custom resource names (not CPU or memory: see num_cpus; not an "
                f"accelerator: {', '.join(sorted(_RESERVED_RESOURCES - {'CPU', 'memory'}))})",
                resources,
            )
            require(
                isinstance(amount, Real)
                and not isinstance(amount, bool)
                and math.isfinite(amount)
                and RESOURCE_UNIT <= amount <= MAX_ACTOR_CPUS,
                _OWNER,
                f"resources[{name!r}]",
                f"a number in [{RESOURCE_UNIT:g} (Ray's precision), {MAX_ACTOR_CPUS}]",
                amount,
            )
        require_int(_OWNER, "max_restarts", self.max_restarts, 0, MAX_RESTARTS)
        require_number(_OWNER, "num_cpus", self.num_cpus, 0, MAX_ACTOR_CPUS)
        require(
            self.num_cpus == 0 or self.num_cpus >= RESOURCE_UNIT,
            _OWNER,
            "num_cpus",
            f"0 or a number in [{RESOURCE_UNIT:g} (Ray's precision), {MAX_ACTOR_CPUS}]",
            self.num_cpus,
        )
        require_number(_OWNER, "call_timeout_s", self.call_timeout_s, 0, MAX_WAIT_S, low_open=True)
        require_number(_OWNER, "start_timeout_s", self.start_timeout_s, 0, MAX_WAIT_S, low_open=True)
        require_int(_OWNER, "calls_in_flight", self.calls_in_flight, 1, MAX_CALLS_IN_FLIGHT)
        require_int(_OWNER, "windows_per_call", self.windows_per_call, 1, MAX_WINDOWS_PER_CALL)
        require_int(_OWNER, "publish_windows", self.publish_windows, 1, MAX_WINDOWS_PER_CALL)
        require_number(_OWNER, "publish_delay_s", self.publish_delay_s, 0, MAX_PUBLISH_DELAY_S)
        require_number(_OWNER, "restart_delay_s", self.restart_delay_s, 0, 3600)
        require(
            self.runtime_env is None or isinstance(self.runtime_env, Mapping),
            _OWNER,
            "runtime_env",
            "None or a mapping (a Ray runtime environment)",
            self.runtime_env,
        )
        if self.runtime_env is not None:
            _check_runtime_env(self.runtime_env)


def _check_runtime_env(runtime_env: Mapping[str, object]) -> None:
    """Ray's own check of a runtime environment (types of ``env_vars``, ``pip``, ...), here rather than in
    the ingest process, where Ray would first refuse it."""
    try:
        from ray.runtime_env import RuntimeEnv
    except ImportError:  # the ray extra is missing: the engine says so when it starts
        return
    try:
        RuntimeEnv(**dict(runtime_env))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_OWNER}.runtime_env is not a valid Ray runtime environment: {error}") from None


RAY_LEAVE_S = 5.0
"""How much longer than ``shutdown_timeout`` the owner's ``stop()`` waits for the Ray ingest process: the
sources' ``close()`` may take all of ``shutdown_timeout``, then the actors are killed and Ray is left (a
cluster the ingest started itself takes a few seconds to stop)."""


class RayProducerError(RuntimeError):
    """A Ray producer was lost for good: its restarts are exhausted, or a call passed its timeout.

    The message names the producer, its Ray node, Ray's error and the restart count; the same values are
    attributes. Pickles (it travels through the engine's error channel to every consumer).
    """

    def __init__(self, message: str, worker: str = "", node_id: str | None = None, restarts: int = 0) -> None:
        super().__init__(message)
        self.worker = worker
        self.node_id = node_id
        self.restarts = restarts

    def __reduce__(self):
        return (type(self), (str(self), self.worker, self.node_id, self.restarts))


def backend_from_flags(owner: str, backend: str, ray_address: str | None) -> RayBackend | None:
    """The ``backend`` of an engine config from the command line's ``--backend`` and ``--ray-address``.

    Raises:
        ValueError: ``<owner>.backend`` is neither ``local`` nor ``ray``, or ``<owner>.ray_address`` is
            given with the local backend.
    """
    require(backend in ("local", "ray"), owner, "backend", "'local' or 'ray'", backend)
    if backend == "local":
        require(ray_address is None, owner, "ray_address", "None unless backend is 'ray'", ray_address)
        return None
    require_ray_address(owner, "ray_address", ray_address)
    return RayBackend(address=ray_address)


def require_ray_address(owner: str, name: str, address: object) -> None:
    """Raise ``ValueError`` unless ``address`` is ``None``, ``"auto"``, ``"local"`` or a cluster address.

    A Ray Client address (``ray://``) is refused: the ingest must join the cluster as a driver on the
    trainer's machine (Ray Client supports neither the actors' concurrency groups nor the driver's import
    path), so it takes the cluster's GCS address even when the script itself connected through Ray Client.
    """
    require(
        address is None or (isinstance(address, str) and address.strip() != ""),
        owner,
        name,
        "None or a nonempty string ('auto', 'local', 'host:port')",
        address,
    )
    require(
        address is None or not address.strip().lower().startswith("ray://"),
        owner,
        name,
        "a cluster's GCS address ('host:port', usually port 6379), not a Ray Client address",
        address,
        "The ingest joins the cluster as a driver on the trainer's machine; a script connected through "
        "Ray Client may leave the address None, and the ingest joins that cluster at its GCS address",
    )
