"""Which rank does what: the ranks of one model (tp_size x pp_size of them, over nnodes machines) and
how they find each other (torchrun's conventions: MASTER_ADDR / MASTER_PORT, RANK / WORLD_SIZE /
LOCAL_RANK in each rank's environment).

Rank r is tensor-parallel rank r % tp_size of pipeline stage r // tp_size; node n runs ranks
[n * per_node, (n + 1) * per_node), its local rank i on GPU base_gpu_id + i. Rank 0 (node 0) is the
driver: it runs the scheduler and hosts the rendezvous store.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from ..server_args import ServerArgs

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Topology:
    tp_size: int
    pp_size: int
    nnodes: int = 1
    node_rank: int = 0

    @classmethod
    def of(cls, server_args: ServerArgs) -> "Topology":
        return cls(server_args.tp_size, server_args.pp_size, server_args.nnodes, server_args.node_rank)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node

    def stage_of(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp_size

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    def peer(self, rank: int, stage: int) -> int:
        """The rank of `stage` with the same tensor-parallel rank as `rank` (its pipeline neighbour)."""
        return stage * self.tp_size + self.tp_rank_of(rank)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens (torchrun's MASTER_ADDR:MASTER_PORT)."""

    host: str
    port: int

    @classmethod
    def of(cls, server_args: ServerArgs) -> "Rendezvous":
        """`dist_init_addr` when given, else a free port on this machine (one node)."""
        if server_args.dist_init_addr is not None:
            host, _, port = server_args.dist_init_addr.rpartition(":")
            return cls(host.strip("[]"), int(port))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return cls("127.0.0.1", sock.getsockname()[1])

    def rank_env(self, topology: Topology, rank: int) -> dict[str, str]:
        """The environment torchrun would give `rank`."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "RANK": str(rank),
            "WORLD_SIZE": str(topology.world_size),
            "LOCAL_RANK": str(topology.local_rank(rank)),
        }


def rank_from_env(environ: Mapping[str, str] = os.environ) -> tuple[Rendezvous, int, int, int]:
    """(rendezvous, rank, world size, local rank) from torchrun's variables; a clear error naming the
    missing ones."""
    missing = [k for k in ENV_KEYS if k not in environ]
    if missing:
        raise RuntimeError(f"a plait rank needs torchrun's environment variables; missing {missing}")
    return (
        Rendezvous(environ["MASTER_ADDR"], int(environ["MASTER_PORT"])),
        int(environ["RANK"]),
        int(environ["WORLD_SIZE"]),
        int(environ["LOCAL_RANK"]),
    )


# LeaderWorkerSet (Kubernetes) gives each pod of a multi-node replica these; SGLang's and vLLM's guides map
# them onto their own start flags by hand in the manifest, plait reads them itself (`lws_defaults`).
LWS_KEYS = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
# NOTE: LWS names the leader's host, not a port; SGLang's LWS example puts its rendezvous on this one.
LWS_RENDEZVOUS_PORT = 20000


def lws_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, object]:
    """The defaults of `--nnodes`, `--node-rank` and `--dist-init-addr` inside a LeaderWorkerSet pod:
    a group of LWS_GROUP_SIZE pods is one replica of nnodes machines, pod LWS_WORKER_INDEX is its node (the
    leader, index 0, serves HTTP; the others run their ranks), meeting at LWS_LEADER_ADDRESS:20000. Empty
    outside one (none of the variables set) and for a group of one; flags on the command line still win."""
    present = [k for k in LWS_KEYS if environ.get(k)]
    if not present:
        return {}
    if len(present) < len(LWS_KEYS):
        missing = sorted(set(LWS_KEYS) - set(present))
        raise ValueError(f"a LeaderWorkerSet pod has all of {list(LWS_KEYS)}; missing {missing}")
    size, index = environ["LWS_GROUP_SIZE"], environ["LWS_WORKER_INDEX"]
    if not size.isdigit() or not index.isdigit() or int(index) >= int(size):
        raise ValueError(f"LWS_GROUP_SIZE={size!r} and LWS_WORKER_INDEX={index!r} are not a group and a member")
    if int(size) == 1:  # a group of one pod is a one-machine replica: nothing to meet
        return {}
    host = environ["LWS_LEADER_ADDRESS"]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address as host:port reads it
    return {"nnodes": int(size), "node_rank": int(index), "dist_init_addr": f"{host}:{LWS_RENDEZVOUS_PORT}"}


def replica_endpoint(endpoint: Optional[str], replica: int) -> Optional[str]:
    """Data-parallel replica `replica`'s copy of a ZMQ endpoint (KV events): the port moved up by its index
    (vLLM's convention), so each replica's scheduler binds its own."""
    if endpoint is None or replica == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{replica}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{endpoint!r} has no port to move up for data-parallel replica {replica}")
    return f"{base}:{int(port) + replica}"
