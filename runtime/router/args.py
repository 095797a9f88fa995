"""`plait router`'s settings: replicas on several machines behind one address (the CLI's flags are generated
from these fields, cli/flags.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROUTING_POLICIES = ("cache_aware", "round_robin")


@dataclass
class RouterArgs:
    """`plait router`'s settings; each field is a flag (`--worker-urls`, `--policy`, ...)."""

    worker_urls: list[str] = dataclasses.field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    # Cache-aware routing: the longest cached prefix wins while the replicas' loads (requests in flight)
    # are within balance_abs_threshold of each other or within balance_rel_threshold times; past both,
    # the least loaded replica. A request no replica holds cache_threshold of goes to the emptiest tree.
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5
    max_tree_items: int = 1 << 22  # prefix items (characters or token ids) remembered per replica
    health_check_interval: float = 5.0
    health_failure_threshold: int = 2  # failed checks in a row that take a replica out
    request_timeout: float = 600.0  # seconds a replica may take to answer one request
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ValueError("the router needs at least one worker URL (--worker-urls http://host:port ...)")
        for url in self.worker_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError(f"worker URLs repeat: {self.worker_urls}")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {list(ROUTING_POLICIES)}, got {self.policy!r}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1.0")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        for name in ("max_tree_items", "health_failure_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_check_interval", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        self.worker_urls = [u.rstrip("/") for u in self.worker_urls]
