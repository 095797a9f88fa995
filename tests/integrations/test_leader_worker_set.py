"""LeaderWorkerSet's variables as `plait serve`'s defaults: LWS_GROUP_SIZE -> --nnodes, LWS_WORKER_INDEX ->
--node-rank, LWS_LEADER_ADDRESS -> --dist-init-addr (port 20000). Two processes on this machine, given only
those variables and the same command, become one tensor-parallel model: the leader serves HTTP, the worker
runs its rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from conftest import free_port
from helpers.model_folders import build_tokenizer, make_folder
from plait.runtime.cli.main import parse_server_args
from plait.runtime.distributed.topology import LWS_RENDEZVOUS_PORT, lws_defaults

LWS = {"LWS_LEADER_ADDRESS": "plait-0.plait.default", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}


def test_the_variables_map_onto_the_flags(monkeypatch):
    assert lws_defaults({}) == {}
    assert lws_defaults({**LWS, "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}) == {}  # one pod: one machine
    assert lws_defaults(LWS) == {"nnodes": 4, "node_rank": 2, "dist_init_addr": "plait-0.plait.default:20000"}
    assert lws_defaults({**LWS, "LWS_LEADER_ADDRESS": "fd00::1"})["dist_init_addr"] == "[fd00::1]:20000"
    with pytest.raises(ValueError, match="missing \\['LWS_WORKER_INDEX'\\]"):
        lws_defaults({k: v for k, v in LWS.items() if k != "LWS_WORKER_INDEX"})
    with pytest.raises(ValueError, match="not a group and a member"):
        lws_defaults({**LWS, "LWS_WORKER_INDEX": "4"})
    for key, value in LWS.items():
        monkeypatch.setenv(key, value)
    args = parse_server_args(["--tp-size", "4"])
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (4, 2, "plait-0.plait.default:20000")
    # flags given on the command line win
    args = parse_server_args(["--nnodes", "1", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:5000"])
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (1, 0, "10.0.0.1:5000")


def rendezvous_port_free() -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", LWS_RENDEZVOUS_PORT))
        except OSError:
            return False
    return True


def test_leader_and_worker_from_the_variables_alone(tmp_path):
    if not rendezvous_port_free():
        pytest.skip(f"port {LWS_RENDEZVOUS_PORT} (LWS's rendezvous) is taken on this machine")
    model = make_folder(tmp_path / "llama", "llama", tokenizer=build_tokenizer(), max_position_embeddings=512)
    port = free_port()
    command = [sys.executable, "-m", "plait.runtime.cli", "serve", "--model-path", model, "--tp-size", "2"]
    command += ["--num-threads", "1", "--max-total-tokens", "2048", "--host", "127.0.0.1", "--port", str(port)]
    procs = []
    for index in (1, 0):  # the worker first: it waits for the leader's rendezvous
        env = {**os.environ, "LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index)}
        log = open(tmp_path / f"pod{index}.log", "w")
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    worker, leader = procs
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert leader.poll() is None and worker.poll() is None, (tmp_path / "pod0.log").read_text()[-3000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, (tmp_path / "pod0.log").read_text()[-3000:]
            time.sleep(0.5)
        r = requests.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        info = requests.get(url + "/get_server_info", timeout=30).json()
        assert (info["tp_size"], info["nnodes"], info["node_rank"]) == (2, 2, 0)
        assert info["dist_init_addr"] == f"127.0.0.1:{LWS_RENDEZVOUS_PORT}"
        log = (tmp_path / "pod1.log").read_text()
        assert "node 1: ranks [1] started, rendezvous at 127.0.0.1:20000" in log, log[-3000:]
    finally:
        leader.terminate()
        try:
            assert worker.wait(timeout=60) is not None  # rank 0 gone: the worker's rank ends by itself
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
