"""Data parallelism (dp_size = 2) behind one Engine: two scheduler processes, each its own KV cache, under
the data-parallel controller. Outputs are one device's, requests spread over both replicas, a
conversation's next turn goes to the replica that cached its prefix, control calls answer for both
(stats summed, integrity, flush, one pin id), and a replica that dies ends the engine's service with
EngineUnavailableError (the server's 503), leaving no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import hf_greedy
from helpers.model_folders import EOS, make_folder
from plait.runtime import Engine
from plait.runtime.engine.tokenizer_manager import EngineUnavailableError
from test_parallel import alive, children_of
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.timeout(600)

GREEDY = {"max_new_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("dp") / "llama", "llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(folder):
    eng = Engine(folder, dp_size=2, num_threads=1, max_total_tokens=2048)
    yield eng
    eng.shutdown()


def test_two_replicas_give_one_devices_outputs_and_share_the_work(engine, folder):
    torch.manual_seed(0)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (5, 9, 17, 30, 6, 12, 8, 21)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, p, 10, eos_ids=[EOS]) for p in prompts]
    stats = engine.get_stats()
    per_replica = [r["prompt_tokens"] for r in stats["dp_replicas"]]
    assert all(n > 0 for n in per_replica) and sum(per_replica) == stats["prompt_tokens"], per_replica
    assert engine.check_integrity()
    assert engine.get_server_info()["max_running_requests"] == 2 * 256  # each replica's CPU default


def test_a_conversations_next_turn_finds_its_prefix_cached(engine):
    history = list(range(40, 90))
    first = engine.generate(input_ids=history, sampling_params=GREEDY)
    turn = history + first["output_ids"] + list(range(100, 110))
    second = engine.generate(input_ids=turn, sampling_params=GREEDY)
    assert second["meta_info"]["cached_tokens"] >= len(history)


def test_control_calls_answer_for_every_replica(engine):
    prefix = list(range(200, 240))
    engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})
    pin = engine.pin_prefix(prefix)
    assert pin["pin_id"] is not None and pin["pinned_tokens"] >= len(prefix) - 1
    assert engine.unpin_prefix(pin["pin_id"]) is True
    assert engine.unpin_prefix(pin["pin_id"]) is False
    assert engine.flush_cache() is True
    assert engine.get_stats()["evictable_tokens"] == 0


def test_a_replica_that_dies_ends_the_engine_without_leftovers(folder):
    eng = Engine(folder, dp_size=2, num_threads=1, max_total_tokens=2048)
    controller = eng._proc.pid
    replicas = children_of(controller)
    assert len(replicas) == 2, replicas
    try:
        os.kill(replicas[1], signal.SIGKILL)
        deadline = time.time() + 60
        while alive(controller) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(controller) and not alive(replicas[0]), "the other replica or the controller lived on"
        time.sleep(1.5)  # the engine's watchdog polls every second
        with pytest.raises(EngineUnavailableError, match="the scheduler process died"):
            eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    finally:
        eng.shutdown()
