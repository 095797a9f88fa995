"""The replicas behind the router: their health, their load, and the checks that take a dead one out.

A replica is healthy until `health_failure_threshold` checks in a row fail (its /health answers other
than 200, or not at all), or a request finds it unreachable or answering 503 (its scheduler died):
then it is out, the routing policy forgets what it sent there (its cache is gone), and requests go
elsewhere. A later check that passes brings it back, with an empty prefix record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp

logger = logging.getLogger("plait.router")


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0  # requests the router has open on it
    failed_checks: int = 0
    last_error: Optional[str] = None
    down_since: Optional[float] = None
    served: int = 0  # requests it answered through the router


class ReplicaSet:
    def __init__(self, urls: list[str], failure_threshold: int, on_down: Callable[[str], None]):
        self.replicas = {url: Replica(url) for url in urls}
        self.failure_threshold = failure_threshold
        self.on_down = on_down  # called with the url of a replica taken out

    def healthy(self) -> list[str]:
        return [r.url for r in self.replicas.values() if r.healthy]

    def load(self) -> dict[str, int]:
        return {r.url: r.in_flight for r in self.replicas.values()}

    def mark_down(self, url: str, why: str) -> None:
        replica = self.replicas[url]
        replica.last_error = why
        if replica.healthy:
            replica.healthy = False
            replica.down_since = time.time()
            logger.error("replica %s taken out: %s", url, why)
            self.on_down(url)

    def mark_up(self, url: str) -> None:
        replica = self.replicas[url]
        replica.failed_checks = 0
        if not replica.healthy:
            logger.info("replica %s is back", url)
            replica.healthy = True
            replica.down_since = None

    async def check_all(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        await asyncio.gather(*(self._check(session, url, timeout_s) for url in self.replicas))

    async def _check(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                ok = resp.status == 200
                why = f"/health answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
        replica = self.replicas[url]
        if ok:
            self.mark_up(url)
            return
        replica.failed_checks += 1
        replica.last_error = why
        if replica.failed_checks >= self.failure_threshold:
            self.mark_down(url, why)

    def status(self) -> list[dict]:
        return [
            {
                "url": r.url,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "served": r.served,
                "last_error": r.last_error,
            }
            for r in self.replicas.values()
        ]
