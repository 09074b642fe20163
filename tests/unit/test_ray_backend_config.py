"""``RayBackend`` validation (no Ray needed: the config never imports it) and lazy imports."""

from __future__ import annotations

import math
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simstream import OnlineDataEngine, OnlineDataEngineCfg, OnlineDataWorkerError
from simstream.ray import RayBackend, RayProducerError
from simstream.ray.backend import backend_from_flags
from tests.support.sources import ScriptedSpec

_BAD_FIELDS = [
    pytest.param("address", "", r"RayBackend\.address must be None or a nonempty string", id="address-empty"),
    pytest.param("address", 5, r"RayBackend\.address must be None or a nonempty string", id="address-int"),
    pytest.param(
        "address",
        "ray://head:10001",
        r"RayBackend\.address must be a cluster's GCS address .*not a Ray Client address, got 'ray://head",
        id="address-ray-client",
    ),
    pytest.param(
        "address",
        "RAY://head:10001",
        r"RayBackend\.address must be a cluster's GCS address .*not a Ray Client address",
        id="address-ray-client-upper-case",
    ),
    pytest.param("resources", ["sim"], r"RayBackend\.resources must be a mapping", id="resources-list"),
    pytest.param(
        "resources", {"CPU": 1}, r"RayBackend\.resources must be a mapping whose keys", id="res-cpu"
    ),
    pytest.param("resources", {"": 1}, r"RayBackend\.resources must be a mapping whose keys", id="res-empty"),
    pytest.param(
        "resources",
        {"sim": 0},
        r"RayBackend\.resources\['sim'\] must be a number in \[0.0001 \(Ray's",
        id="res-0",
    ),
    pytest.param("resources", {"sim": 1e-5}, r"RayBackend\.resources\['sim'\] must be", id="res-precision"),
    pytest.param("resources", {"TPU": 1}, r"not an accelerator: FURIOSA, GPU, HPU, MBLT", id="res-tpu"),
    pytest.param(
        "resources", {"GPU": 0.5}, r"RayBackend\.resources must be a mapping whose keys", id="res-gpu"
    ),
    pytest.param(
        "num_cpus",
        1e-5,
        r"RayBackend\.num_cpus must be 0 or a number in \[0.0001 \(Ray's precision\)",
        id="cpus-precision",
    ),
    pytest.param("resources", {"sim": True}, r"RayBackend\.resources\['sim'\] must be", id="res-bool"),
    pytest.param("resources", {"sim": math.inf}, r"RayBackend\.resources\['sim'\] must be", id="res-inf"),
    pytest.param(
        "max_restarts", -1, r"RayBackend\.max_restarts must be an int in \[0, 10000\]", id="restarts-neg"
    ),
    pytest.param("max_restarts", 1.0, r"RayBackend\.max_restarts must be an int", id="restarts-float"),
    pytest.param("max_restarts", True, r"RayBackend\.max_restarts must be an int", id="restarts-bool"),
    pytest.param("num_cpus", -0.5, r"RayBackend\.num_cpus must be a number in \[0, 1024\]", id="cpus-neg"),
    pytest.param(
        "num_cpus", math.nan, r"RayBackend\.num_cpus must be a number in \[0, 1024\]", id="cpus-nan"
    ),
    pytest.param(
        "call_timeout_s", 0, r"RayBackend\.call_timeout_s must be a number in \(0, 1e6\]", id="call-0"
    ),
    pytest.param("call_timeout_s", math.inf, r"RayBackend\.call_timeout_s must be", id="call-inf"),
    pytest.param(
        "start_timeout_s", 0.0, r"RayBackend\.start_timeout_s must be a number in \(0", id="start-0"
    ),
    pytest.param(
        "calls_in_flight", 0, r"RayBackend\.calls_in_flight must be an int in \[1, 64\]", id="flight-0"
    ),
    pytest.param(
        "calls_in_flight", 65, r"RayBackend\.calls_in_flight must be an int in \[1, 64\]", id="flight-65"
    ),
    pytest.param(
        "windows_per_call", 0, r"RayBackend\.windows_per_call must be an int in \[1, 1024\]", id="per-call-0"
    ),
    pytest.param(
        "publish_windows", 0, r"RayBackend\.publish_windows must be an int in \[1, 1024\]", id="group-0"
    ),
    pytest.param(
        "publish_windows", 1025, r"RayBackend\.publish_windows must be an int in \[1, 1024\]", id="group-big"
    ),
    pytest.param(
        "publish_delay_s", -0.1, r"RayBackend\.publish_delay_s must be a number in \[0, 10\]", id="hold-neg"
    ),
    pytest.param(
        "publish_delay_s",
        float("inf"),
        r"RayBackend\.publish_delay_s must be a number in \[0, 10\]",
        id="hold-inf",
    ),
    pytest.param(
        "restart_delay_s", -1, r"RayBackend\.restart_delay_s must be a number in \[0, 3600\]", id="delay"
    ),
    pytest.param(
        "runtime_env", "env", r"RayBackend\.runtime_env must be None or a mapping", id="runtime-env"
    ),
    pytest.param(  # Ray's own check, before anything starts (it used to fail inside the ingest process)
        "runtime_env",
        {"env_vars": {"OMP_NUM_THREADS": 1}},
        r"RayBackend\.runtime_env is not a valid Ray runtime environment: runtime_env\['env_vars'\] must "
        r"be of type Dict\[str, str\], but the value 1 is of type <class 'int'>",
        id="runtime-env-vars",
    ),
    pytest.param(
        "runtime_env",
        {"pip": 5},
        r"RayBackend\.runtime_env is not a valid Ray runtime environment: runtime_env\['pip'\] must be of "
        r"type str or List\[str\]",
        id="runtime-env-pip",
    ),
]


@pytest.mark.parametrize(("name", "value", "message"), _BAD_FIELDS)
def test_every_field_is_checked_on_construction_naming_field_and_range(name, value, message):
    with pytest.raises(ValueError, match=message):
        RayBackend(**{name: value})


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_max_restarts_accepts_exactly_its_range(value):
    if 0 <= value <= 10_000:
        assert RayBackend(max_restarts=value).max_restarts == value
    else:
        with pytest.raises(ValueError, match=r"RayBackend\.max_restarts must be an int in \[0, 10000\]"):
            RayBackend(max_restarts=value)


@given(st.integers(min_value=-100, max_value=200))
def test_calls_in_flight_accepts_exactly_its_range(value):
    if 1 <= value <= 64:
        assert RayBackend(calls_in_flight=value).calls_in_flight == value
    else:
        with pytest.raises(ValueError, match=r"RayBackend\.calls_in_flight must be an int in \[1, 64\]"):
            RayBackend(calls_in_flight=value)


@given(
    st.sampled_from(["call_timeout_s", "start_timeout_s"]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
)
def test_timeouts_accept_exactly_finite_positive_seconds_up_to_1e6(name, value):
    if math.isfinite(value) and 0 < value <= 1e6:
        assert getattr(RayBackend(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=rf"RayBackend\.{name} must be a number in \(0, 1e6\]"):
            RayBackend(**{name: value})


def test_a_valid_runtime_env_is_kept_as_given():
    env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    assert RayBackend(runtime_env=env).runtime_env == env


def test_numpy_amounts_are_accepted_and_reach_ray_as_floats():
    backend = RayBackend(num_cpus=np.float32(0.5), resources={"sim": np.int64(2)})
    assert backend.num_cpus == 0.5 and backend.resources["sim"] == 2
    assert RayBackend(num_cpus=0).num_cpus == 0  # no CPU reserved: allowed


@given(
    st.dictionaries(st.text(min_size=1, max_size=5), st.floats(min_value=0.001, max_value=1024), max_size=3)
)
def test_custom_resources_accept_positive_amounts(resources):
    from simstream.ray.backend import _RESERVED_RESOURCES

    if any(name.strip() == "" or name in _RESERVED_RESOURCES for name in resources):
        with pytest.raises(ValueError, match=r"RayBackend\.resources"):
            RayBackend(resources=resources)
    else:
        assert dict(RayBackend(resources=resources).resources) == resources


def test_engine_config_refuses_a_backend_that_is_not_a_ray_backend_before_anything_starts():
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, backend="ray")
    with pytest.raises(
        ValueError, match=r"OnlineDataEngineCfg\.backend must be None .*RayBackend, got 'ray'"
    ):
        OnlineDataEngine(cfg)


def test_flags_build_the_backend():
    assert backend_from_flags("DemoConfig", "local", None) is None
    assert backend_from_flags("DemoConfig", "ray", "auto") == RayBackend(address="auto")
    with pytest.raises(ValueError, match=r"DemoConfig\.backend must be 'local' or 'ray', got 'mpi'"):
        backend_from_flags("DemoConfig", "mpi", None)
    with pytest.raises(ValueError, match=r"DemoConfig\.ray_address must be None unless backend is 'ray'"):
        backend_from_flags("DemoConfig", "local", "auto")
    with pytest.raises(
        ValueError, match=r"DemoConfig\.ray_address must be a cluster's GCS address .*Ray Client"
    ):
        backend_from_flags("DemoConfig", "ray", " ray://head:10001")


def test_producer_error_pickles_with_its_fields():
    import pickle

    error = RayProducerError("producer-1 lost", "producer-1", "ab12", 3)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, RuntimeError)
    assert (str(copy), copy.worker, copy.node_id, copy.restarts) == (
        "producer-1 lost",
        "producer-1",
        "ab12",
        3,
    )


def test_importing_simstream_and_its_data_api_never_imports_ray():
    code = (
        "import sys, pickle, simstream, simstream.data, simstream.ray\n"
        "from simstream import OnlineDataEngineCfg\n"
        "cfg = OnlineDataEngineCfg(backend=simstream.ray.RayBackend(resources={'sim': 1}))\n"
        "pickle.loads(pickle.dumps(cfg))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("address", "joined"), [(None, "10.0.0.1:6379"), ("127.0.0.1:7777", "127.0.0.1:7777")]
)
def test_the_ingest_joins_the_scripts_cluster_only_when_no_address_is_given(monkeypatch, address, joined):
    """A script already connected to Ray (faked here: no cluster in unit tests) lends its cluster to
    ``address=None``; an explicit address is the user's choice and is kept."""
    ray = pytest.importorskip("ray")
    from types import SimpleNamespace

    from simstream.engine.lifecycle import _ray_ingest_spec

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.1:6379"))
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), buffer_size=4, backend=RayBackend(address=address))
    spec = _ray_ingest_spec(None, cfg, 2, joining=None)
    assert spec.label == "ray-ingest" and spec.args[4] == joined


def test_an_actor_exception_only_ray_could_carry_keeps_its_type_message_and_the_actors_traceback():
    """A class defined in a function (or an exception holding a lambda) crosses Ray by value but cannot
    reach the error channel, which pickles by reference: it arrives as OnlineDataWorkerError with the
    actor's traceback (it once lost the traceback), while a plain one arrives as itself."""
    from ray.exceptions import RayTaskError

    from simstream.ray.ingest import _original

    def local_error() -> Exception:
        class SimulatorCrashed(Exception):
            pass

        return SimulatorCrashed("physics exploded")

    actor_traceback = 'Traceback (most recent call last):\n  File "source.py", line 7, in rollout\n'
    wrapped = _original(RayTaskError("ProducerActor.generate", actor_traceback, local_error()))
    assert isinstance(wrapped, OnlineDataWorkerError)
    first_line = str(wrapped).splitlines()[0]
    assert first_line.startswith(f"Worker raised {__name__}.test_an_actor_exception_only_ray_could_carry_")
    assert first_line.endswith(".<locals>.local_error.<locals>.SimulatorCrashed: physics exploded")
    assert 'File "source.py", line 7, in rollout' in str(wrapped)
    plain = KeyError("scripted failure")
    assert _original(RayTaskError("ProducerActor.generate", actor_traceback, plain)) is plain
    # no cause of its own (Ray could not rebuild it, or it is another task's error): what is sent pickles
    # by reference and still carries the actor's traceback
    inner = RayTaskError("ProducerActor.build", actor_traceback, local_error())
    for cause in (None, inner):
        sent = _original(RayTaskError("ProducerActor.generate", actor_traceback, cause))
        assert type(pickle.loads(pickle.dumps(sent))) is type(sent)
        assert 'File "source.py", line 7, in rollout' in str(sent)


def test_mappings_are_kept_as_dicts_so_the_config_pickles():
    """A MappingProxyType passed validation, then engine.start() failed to pickle it, naming no field."""
    import pickle
    from types import MappingProxyType

    backend = RayBackend(
        resources=MappingProxyType({"sim": 1}), runtime_env=MappingProxyType({"env_vars": {}})
    )
    assert isinstance(backend.resources, dict) and isinstance(backend.runtime_env, dict)
    copy = pickle.loads(pickle.dumps(backend))
    assert copy == backend and type(copy.resources) is dict and type(copy.runtime_env) is dict


def test_a_validated_backend_keeps_its_mappings_as_validated():
    """The mappings were plain dicts: a change after construction (NaN, a reserved resource) reached
    Ray unchecked, and a backend could not be hashed."""
    import dataclasses

    given_resources = {"sim": 1}
    backend = RayBackend(resources=given_resources, runtime_env={"env_vars": {"A": "1"}})
    given_resources["sim"] = math.nan  # the caller's dict is not the backend's
    assert backend.resources == {"sim": 1}
    message = "RayBackend.resources cannot be changed: the backend was validated with it; make another "
    for change in (
        lambda: backend.resources.__setitem__("CPU", -5),
        lambda: backend.resources.update(sim=math.nan),
        lambda: backend.resources.pop("sim"),
        lambda: backend.resources.clear(),
    ):
        with pytest.raises(TypeError, match=re.escape(message)):
            change()
    with pytest.raises(TypeError, match=re.escape("RayBackend.runtime_env cannot be changed")):
        del backend.runtime_env["env_vars"]
    assert backend.resources == {"sim": 1} and backend.runtime_env == {"env_vars": {"A": "1"}}
    assert hash(RayBackend(resources={"sim": 1})) == hash(RayBackend(resources={"sim": 1.0}))
    assert dataclasses.replace(backend, resources={"sim": 2}).resources == {"sim": 2}
    # configs are logged with asdict, which rebuilds a dict subclass from its pairs
    assert dataclasses.asdict(backend)["resources"] == {"sim": 1}
    cfg = OnlineDataEngineCfg(source=ScriptedSpec(), backend=backend)
    assert dataclasses.asdict(cfg)["backend"]["runtime_env"] == {"env_vars": {"A": "1"}}
