"""The scheduler's control calls (typed messages from the tokenizer manager, one reply each): flushing the
cache, stats, the integrity check, prefix pins, and loading and unloading LoRA adapters."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..io_struct import (
    CheckIntegrityReq,
    ControlReq,
    FlushCacheReq,
    GetStatsReq,
    LoadLoraAdapterReq,
    PinPrefixReq,
    UnloadLoraAdapterReq,
    UnpinPrefixReq,
)
from ..lora.adapter import LoraError
from .adapters import SchedulerAdapters
from .kv_manager import KVManager


class ControlHandlers:
    def __init__(
        self,
        kv: KVManager,
        is_idle: Callable[[], bool],
        get_stats: Callable[[], dict],
        check_integrity: Callable[[], bool],
        adapters: Optional[SchedulerAdapters] = None,
    ):
        self.kv = kv
        self.is_idle = is_idle
        self.get_stats = get_stats
        self.check_integrity = check_integrity
        self.adapters = adapters
        self._handlers: dict[type, Callable[[Any], Any]] = {
            FlushCacheReq: self._flush_cache,
            GetStatsReq: self._stats,
            CheckIntegrityReq: self._check,
            PinPrefixReq: self._pin,
            UnpinPrefixReq: self._unpin,
            LoadLoraAdapterReq: self._load_lora,
            UnloadLoraAdapterReq: self._unload_lora,
        }

    def handle(self, msg: ControlReq) -> Any:
        """The reply's result; raises for a bad call (the caller turns it into the reply's error)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ValueError(f"unknown control request {type(msg).__name__}")
        return handler(msg)

    def _flush_cache(self, msg: FlushCacheReq) -> bool:
        if not self.is_idle():
            return False
        self.kv.flush()
        return True

    def _stats(self, msg: GetStatsReq) -> dict:
        self.kv.expire_pins()
        return self.get_stats()

    def _check(self, msg: CheckIntegrityReq) -> bool:
        return self.check_integrity()

    def _pin(self, msg: PinPrefixReq) -> dict:
        return self.kv.pin(msg.token_ids, msg.ttl)

    def _unpin(self, msg: UnpinPrefixReq) -> bool:
        return self.kv.unpin(msg.pin_id)

    def _lora(self) -> SchedulerAdapters:
        if self.adapters is None:
            raise LoraError("LoRA adapters are off: start the server with --enable-lora or --lora-paths")
        return self.adapters

    def _load_lora(self, msg: LoadLoraAdapterReq) -> dict:
        return self._lora().load(msg)

    def _unload_lora(self, msg: UnloadLoraAdapterReq) -> bool:
        return self._lora().unload(msg)
