"""A real multi-node Ray cluster for tests, on 127.0.0.1 (``ray.cluster_utils.Cluster``).

    with ray_cluster(head_cpus=0, nodes=[2, 2, 2]) as cluster:   # pytest.skip without Ray
        cluster.address                                           # "127.0.0.1:PORT" of the GCS
        cluster.remove(cluster.nodes[1])                          # its raylet and actors killed

Each node is a real raylet (its own processes, object store and resources); the head, with
``head_cpus`` CPUs (0: it runs no node of a job, like a login machine), holds the GCS. Every node
uses node ip 127.0.0.1, a 75 MiB object store and no dashboard; nothing is sent to any other
address (Ray is told not to swap 127.0.0.1 for the machine's outside address, see
tidal.backends.ray). ``shutdown`` kills every process of the cluster, the actors' children with
their actors (they die with their parent, PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# before Ray is imported anywhere in this process: its constants read it at import
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray >= 2.5x turns token authentication on for a node it starts when a token file exists
# (~/.ray/auth_token, left by any earlier local `ray.init()`), so a machine added later would
# refuse the head's requests; a test cluster on 127.0.0.1 runs without it, every node alike
# (the processes the tests start inherit this)
os.environ["RAY_AUTH_MODE"] = "disabled"

OBJECT_STORE_BYTES = 75 * 2**20  # Ray's smallest
NODE_ARGS: dict[str, Any] = {"node_ip_address": "127.0.0.1", "object_store_memory": OBJECT_STORE_BYTES,
                             "include_dashboard": False}


class RayCluster:
    def __init__(self, head_cpus: int, nodes: list[int]) -> None:
        from ray.cluster_utils import Cluster

        self._cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "num_cpus": head_cpus})
        self.nodes: list[Any] = [self.add(cpus) for cpus in nodes]

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def add(self, cpus: int) -> Any:
        args = {k: v for k, v in NODE_ARGS.items() if k != "include_dashboard"}
        node = self._cluster.add_node(num_cpus=cpus, **args)
        self._cluster.wait_for_nodes()
        return node

    def remove(self, node: Any) -> None:
        """Kill the node's raylet and every process of it (SIGKILL: a machine lost)."""
        self._cluster.remove_node(node, allow_graceful=False)
        if node in self.nodes:
            self.nodes.remove(node)

    def node_of(self, ray_node_id: str) -> Any:
        return next(n for n in self.nodes if n.node_id == ray_node_id)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self._cluster.shutdown()


@contextmanager
def ray_cluster(head_cpus: int = 0, nodes: list[int] | None = None) -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="the ray backend's tests need Ray: pip install 'tidal[ray]'")
    cluster = RayCluster(head_cpus, nodes or [])
    try:
        yield cluster
    finally:
        cluster.shutdown()


def kill_namespace(namespace: str) -> None:
    """Kill every actor left in ``namespace`` (detached actors outlive the backend that made them)."""
    import ray

    if not ray.is_initialized():
        return
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace:
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            except ValueError:
                pass
