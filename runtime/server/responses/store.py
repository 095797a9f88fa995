"""Responses kept for `previous_response_id` and GET /v1/responses/{id}, backed by the prefix cache.

Each stored response holds its body, the conversation so far as chat messages (its instructions excluded, as
OpenAI does not carry them over), and the token ids of its prompt and output. The newest response of each
conversation also pins those tokens in the radix cache (Engine.pin_prefix, with a TTL): a turn continued by id
then prefills only what is new, even after other traffic would have evicted the conversation. When a turn is
continued, the pin moves to the new turn, whose tokens begin with the old ones.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger("plait.server")

MAX_STORED = 1024  # responses kept (the oldest are forgotten first)
MAX_PINNED = 64  # conversations whose tokens stay pinned at once
PIN_TTL_S = 600.0  # a pin expires unless the conversation goes on


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, for the next turn's prompt
    token_ids: list[int]  # prompt + output: what the prefix cache holds of this turn
    pin_id: Optional[int] = None


class ResponseStore:
    def __init__(self, engine: Any, max_stored: int = MAX_STORED, max_pinned: int = MAX_PINNED) -> None:
        self._engine = engine
        self._max_stored = max_stored
        self._max_pinned = max_pinned
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._pinned: OrderedDict[str, None] = OrderedDict()  # response ids holding a pin, oldest first

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._responses.get(response_id)

    async def put(self, response_id: str, stored: StoredResponse, previous_id: Optional[str]) -> None:
        """Keep `stored`; pin its tokens and unpin the turn it continues."""
        self._responses[response_id] = stored
        while len(self._responses) > self._max_stored:
            old_id, _ = next(iter(self._responses.items()))
            await self.delete(old_id)
        if previous_id is not None:
            await self._unpin(previous_id)
        stored.pin_id = await self._pin(stored.token_ids)
        if stored.pin_id is not None:
            self._pinned[response_id] = None
        while len(self._pinned) > self._max_pinned:
            await self._unpin(next(iter(self._pinned)))

    async def delete(self, response_id: str) -> bool:
        await self._unpin(response_id)
        return self._responses.pop(response_id, None) is not None

    async def _pin(self, token_ids: list[int]) -> Optional[int]:
        try:
            result = await asyncio.to_thread(self._engine.pin_prefix, token_ids, PIN_TTL_S)
        except Exception as e:  # noqa: BLE001 - a response is good without its pin (the cache may still hold it)
            logger.warning("could not pin a stored response's tokens (%s: %s)", type(e).__name__, e)
            return None
        return result.get("pin_id")

    async def _unpin(self, response_id: str) -> None:
        self._pinned.pop(response_id, None)
        stored = self._responses.get(response_id)
        if stored is None or stored.pin_id is None:
            return
        pin_id, stored.pin_id = stored.pin_id, None
        try:
            await asyncio.to_thread(self._engine.unpin_prefix, pin_id)
        except Exception as e:  # noqa: BLE001 - the pin expires by itself
            logger.warning("could not unpin pin %s (%s: %s)", pin_id, type(e).__name__, e)
