"""One real two-node Ray cluster per module, on 127.0.0.1 inside a private network namespace.

The head node stands for the trainer's machine; a second node holds the ``sim`` resource, and every
producer actor requires it, so windows cross Ray's object transfer between two raylets. Every test
checks that its engine gave the ``sim`` resources back and left no process of ours; the module checks that
no Ray process outlives it.
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import os
import threading
import time

import pytest

from tests.conftest import in_private_network_namespace

SIM_CPUS = 4
_BOUND_S = 30.0

if not in_private_network_namespace():  # pragma: no cover - pytest_ignore_collect keeps us out
    pytest.exit(
        "tests/ray_backend must run inside `unshare -n` with lo up: use `make test-ray`", returncode=4
    )


def _descendants(root: int) -> dict[int, str]:
    """pid -> command name of every process below ``root`` (from /proc; no psutil needed)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        parents[int(entry)], names[int(entry)] = int(fields[1]), name
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = names[pid]
                frontier.append(pid)
    return found


def ray_processes() -> dict[int, str]:
    return {
        pid: name
        for pid, name in _descendants(os.getpid()).items()
        if any(
            part in name for part in ("raylet", "gcs_server", "ray::", "plasma", "dashboard", "log_monitor")
        )
    }


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray_cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 200 * 2**20},
    )
    try:
        sim_node = ray_cluster.add_node(
            num_cpus=SIM_CPUS, resources={"sim": SIM_CPUS}, object_store_memory=200 * 2**20
        )
        ray.init(address=ray_cluster.address, logging_level="WARNING", log_to_driver=False)
        nodes = [node for node in ray.nodes() if node["Alive"]]
        assert len(nodes) == 2
        for node in nodes:  # every server of the test binds to loopback only
            assert ipaddress.ip_address(node["NodeManagerAddress"]) in ipaddress.ip_network("127.0.0.0/8")
        yield ray_cluster, sim_node
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
        deadline = time.monotonic() + _BOUND_S
        while ray_processes() and time.monotonic() < deadline:
            threading.Event().wait(0.1)
        assert not ray_processes(), f"Ray processes outlived the cluster: {ray_processes()}"


def sim_available() -> float:
    import ray

    return ray.available_resources().get("sim", 0.0)


def wait_for(predicate, what: str, timeout: float = _BOUND_S) -> None:
    """Poll ``predicate`` (bounded) until true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        threading.Event().wait(0.05)


@pytest.fixture(autouse=True)
def no_leaks(cluster):
    """Overrides the suite's check: Ray keeps threads of its own; ours and every actor must be gone."""
    yield
    wait_for(lambda: sim_available() == SIM_CPUS, "the producers' sim resources to return to the cluster")
    for child in mp.active_children():
        child.join(5.0)
    assert not mp.active_children(), "an ingest process outlived its engine"
