"""The hierarchical cache's settings checked when the server's settings are built (no torch: the engine's
process imports the settings before it needs torch)."""

from __future__ import annotations

from typing import Any

WRITE_POLICIES = ("write_through", "write_back")
LOAD_POLICIES = ("wait", "hold")
# Speculation whose drafter keeps a KV pool of its own at the target's slots: a prefix loaded back would
# bring the target's K/V but not the drafter's.
_DRAFTER_POOL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")


def check_hierarchical_cache(args: Any) -> None:
    """ValueError naming what is wrong with `args`' hicache_* settings, or the setting it cannot be combined
    with yet."""
    if args.hicache_write_policy not in WRITE_POLICIES:
        raise ValueError(
            f"hicache_write_policy must be one of {list(WRITE_POLICIES)}, got {args.hicache_write_policy!r}"
        )
    if args.hicache_load_policy not in LOAD_POLICIES:
        raise ValueError(f"hicache_load_policy must be one of {list(LOAD_POLICIES)}, got {args.hicache_load_policy!r}")
    for name in ("hicache_ratio", "hicache_size"):
        v = getattr(args, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")
    if not args.enable_hierarchical_cache:
        return
    if args.hicache_size == 0 and args.hicache_ratio == 0:
        raise ValueError("enable_hierarchical_cache needs room: set hicache_ratio > 0 or hicache_size (GB) > 0")
    if args.disable_radix_cache:
        raise ValueError(
            "enable_hierarchical_cache keeps the radix cache's prefixes in host memory: it needs the radix cache on"
        )
    if args.pp_size > 1 and args.hicache_size > 0:
        # NOTE: every rank's host shard must hold as many slots as rank 0's (host_copies.py); GB over the
        # bytes of a token gives each pipeline stage its own count where the stages' layers differ.
        raise ValueError(
            f"enable_hierarchical_cache with pp_size {args.pp_size} sizes the host tier by hicache_ratio only "
            f"(the stages' shards must hold the same tokens): set hicache_size 0, got {args.hicache_size}"
        )
    if args.hicache_load_policy == "hold" and (args.tp_size > 1 or args.pp_size > 1):
        # NOTE: the other ranks replay rank 0's loads before the next step (host_copies.py) and their steps
        # must wait for them on their own devices; a held load's request could be scheduled before theirs land.
        raise ValueError(
            f"hicache_load_policy='hold' runs on one device only (tp_size {args.tp_size}, pp_size {args.pp_size}): "
            "use 'wait'"
        )
    if args.speculative_algorithm in _DRAFTER_POOL_ALGORITHMS:
        raise ValueError(
            f"enable_hierarchical_cache is not supported with speculative_algorithm={args.speculative_algorithm} "
            "yet: the drafter's KV pool is not saved to the host tier (NGRAM speculation works)"
        )
