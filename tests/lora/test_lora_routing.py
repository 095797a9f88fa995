"""Prefix affinity keyed by the cache namespace (issue 36): `plait router` and the data-parallel controller
send a request where its prefix is cached under its own LoRA adapter and cache salt, never where only
another namespace's copy of the same text is (a replica's prefix cache shares nothing across them)."""

from __future__ import annotations

import pytest
from plait.runtime.distributed.data_parallel import DataParallelController
from plait.runtime.io_struct import ControlReply, LoadLoraAdapterReq, TokenizedGenerateReq
from plait.runtime.request_options import RequestOptions, cache_key_prompt
from plait.runtime.router.app import cache_namespace, routing_key
from plait.runtime.router.policy import CacheAwarePolicy
from plait.runtime.sampling_params import SamplingParams


def test_router_keys_carry_the_adapter_and_the_salt():
    text, ids = "hello there", [5, 6, 7]
    assert routing_key("/generate", {"text": text}) == text  # the base model, unsalted: as before
    a = routing_key("/generate", {"text": text, "lora_path": "a"})
    assert a != text and a.endswith(text) and a != routing_key("/generate", {"text": text, "lora_path": "b"})
    assert routing_key("/generate", {"text": text, "cache_salt": "t1"}) not in (text, a)
    assert routing_key("/generate", {"input_ids": ids, "lora_path": "a"}) == (("a", None), *ids)
    # the OpenAI routes name the adapter in `model`: SGLang's "base:adapter" and vLLM's bare name alike
    assert cache_namespace("/v1/completions", {"model": "base:a"}) == cache_namespace("/v1/completions", {"model": "a"})
    assert cache_namespace("/v1/chat/completions", {"model": "a", "cache_salt": "t1"}) == ("a", "t1")
    assert cache_namespace("/v1/completions", {"model": ""}) is None
    assert cache_namespace("/generate", {"model": "a"}) is None  # /generate's adapter is lora_path alone


def test_router_policy_keeps_namespaces_apart():
    policy = CacheAwarePolicy()
    replicas, load = ["r0", "r1"], {"r0": 0, "r1": 0}
    prompt = "a long shared system prompt " * 4
    base = policy.choose(routing_key("/generate", {"text": prompt}), replicas, load).replica
    salted_key = routing_key("/generate", {"text": prompt, "cache_salt": "tenant"})
    salted = policy.choose(salted_key, replicas, load).replica
    assert salted != base  # a new prefix: the emptiest tree, not the base copy's replica
    assert policy.choose(salted_key, replicas, load).replica == salted  # and it stays there


class _Socket:
    def __init__(self):
        self.sent = []

    def send_pyobj(self, msg):
        self.sent.append(msg)


def _controller(n: int = 2) -> DataParallelController:
    """The controller's dispatch state without its replica processes (what `dispatch` reads)."""
    dp = DataParallelController.__new__(DataParallelController)
    dp.n, dp.policy, dp.names = n, CacheAwarePolicy(), [f"replica{i}" for i in range(n)]
    dp.open, dp.load, dp.to_replicas = {}, [0] * n, [_Socket() for _ in range(n)]
    dp.pending_calls, dp.pins = {}, {}
    return dp


def _req(rid: str, ids: list[int], **options) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(
        input_ids=ids, sampling_params=SamplingParams(), options=RequestOptions(rid=rid, **options)
    )


def _replica_of(dp: DataParallelController, rid: str) -> int:
    return dp.open[rid]


def test_data_parallel_dispatch_keys_by_namespace():
    dp = _controller()
    ids = list(range(10, 60))
    dp.dispatch(_req("base", ids))
    dp.dispatch(_req("salted", ids, cache_salt="tenant"))
    dp.dispatch(_req("adapter", ids, lora_path="a"))
    dp.dispatch(_req("salted-again", ids + [1, 2], cache_salt="tenant"))
    dp.dispatch(_req("adapter-again", ids + [3], lora_path="a"))
    assert _replica_of(dp, "salted") != _replica_of(dp, "base")  # not sent after the base model's copy
    assert _replica_of(dp, "salted-again") == _replica_of(dp, "salted")
    assert _replica_of(dp, "adapter-again") == _replica_of(dp, "adapter")
    # the key is the replicas' own prefix-cache key
    assert dp.policy.tree.match(tuple(cache_key_prompt(ids, "a", None)))


def test_data_parallel_load_reply_is_one_replicas():
    dp = _controller()
    call = LoadLoraAdapterReq(7, lora_name="a", lora_path="/x")
    assert dp.dispatch(call) is None and all(s.sent == [call] for s in dp.to_replicas)
    facts = {"name": "a", "rank": 8, "targets": ["qkv"]}
    assert dp.collect(0, ControlReply(7, result=dict(facts))) is None
    merged = dp.collect(1, ControlReply(7, result=dict(facts)))
    assert merged.result == facts  # not summed as stats are (rank 16 for two replicas)


def test_data_parallel_replicas_serve_adapters(tmp_path):
    """Two replicas behind one Engine: an adapter loaded at start-up and one loaded while serving answer
    as transformers + PEFT merged on whichever replica a request lands; the load's reply is one adapter's."""
    pytest.importorskip("peft")
    from conftest import make_random_model
    from helpers.lora_adapters import make_peft_adapter, merged_greedy
    from plait.runtime import Engine

    base = make_random_model(str(tmp_path / "base"), "llama")
    a = make_peft_adapter(base, str(tmp_path / "a"), 8, seed=41)
    b = make_peft_adapter(base, str(tmp_path / "b"), 4, seed=42)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31, 32, 33]]
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    refs = {"a": merged_greedy(base, a, prompts, 6), "b": merged_greedy(base, b, prompts, 6)}
    with Engine(model_path=base, dp_size=2, num_threads=1, lora_paths=[f"a={a}"], max_lora_rank=8) as engine:
        assert engine.load_lora_adapter("b", b)["rank"] == 4
        for name in ("a", "b"):
            outs = engine.generate(input_ids=prompts * 2, sampling_params=greedy, lora_path=name)
            assert [o["output_ids"] for o in outs] == refs[name] * 2, name
        stats = engine.get_stats()
        assert all(r["prompt_tokens"] > 0 for r in stats["dp_replicas"])  # both replicas served
        long = list(range(40, 90))
        salted = RequestOptions(cache_salt="t1")
        engine.generate(input_ids=long, sampling_params=greedy, options=salted)
        again = engine.generate(input_ids=long + [3], sampling_params=greedy, options=salted)
        assert again["meta_info"]["cached_tokens"] >= len(long) - 1  # sent where its namespace's copy is
        assert engine.unload_lora_adapter("b") is True
        assert engine.check_integrity()
