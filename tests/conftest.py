"""Shared fixtures. Engines are expensive (a scheduler process + model load): share them per module."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

# Triton picks interpreted or compiled mode at its first import (transformers imports it), so the
# CPU-interpreter choice must be made before anything else loads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(2)

# dtype "auto" on a CPU with AMX or AVX512-BF16 is bfloat16 (quant/cpu_features.py); the suite's references are
# transformers' float32, so engines here resolve "auto" to float32 unless the runner asks otherwise (servers
# inherit it).
os.environ.setdefault("PLAIT_CPU_DTYPE", "float32")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from plait.runtime.models.default_model import default_model_path as resolve

    return resolve()


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def backends(default_tokenizer):
    """Both grammar backends on the default tokenizer (the structured-output tests without a model)."""
    from plait.runtime.constrained import create_grammar_backend

    made = {name: create_grammar_backend(name, default_tokenizer) for name in ("xgrammar", "outlines")}
    yield made
    for backend in made.values():
        backend.shutdown()


@pytest.fixture(scope="module")
def tables(backends):
    """The xgrammar backend's token tables."""
    from plait.runtime.constrained.token_tables import TokenTables

    return TokenTables(backends["xgrammar"].vocab)


def make_random_model(folder: str, arch: str, seed: int = 0) -> str:
    """Write a small random Hugging Face model (config.json + safetensors) for reference tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        # NOTE: a large init makes the logits peaked, so greedy decoding has no near-ties
        # that float noise could flip.
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    )
    if arch == "llama":
        cfg = AutoConfig.for_model("llama", rope_theta=10000.0, tie_word_embeddings=False, **common)
    elif arch == "qwen2":
        cfg = AutoConfig.for_model("qwen2", rope_theta=10000.0, tie_word_embeddings=True, **common)
    elif arch == "qwen3":
        cfg = AutoConfig.for_model("qwen3", rope_theta=10000.0, head_dim=16, tie_word_embeddings=False, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(folder)
    return folder


def tiny_llama_model(arch: str, dtype=torch.float16, device="cpu", scale=0.3, **shape):
    """plait's own LlamaForCausalLM (any of its architectures) at a tiny shape (overridable by keyword),
    random weights: norms ~1, the rest N(0, scale). Built as model_loader builds it (default dtype and
    device set), so the rotary caches stay float32."""
    from plait.runtime.models.config import ModelConfig
    from plait.runtime.models.llama import LlamaForCausalLM

    dims = (
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=128,
        )
        | shape
    )
    cfg = ModelConfig(
        architecture=arch,
        qk_norm=arch == "Qwen3ForCausalLM",
        attention_bias=arch == "Qwen2ForCausalLM",
        tie_word_embeddings=arch == "Qwen2ForCausalLM",
        **dims,
    )
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_position=64)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1 if "norm" in name else scale)
    return model.eval()


@pytest.fixture(scope="session")
def random_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("random_models")
    return {arch: make_random_model(str(root / arch), arch) for arch in ("llama", "qwen2", "qwen3")}


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Greedy continuation with transformers, stopping at EOS like the engine."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=list(eos_ids) or None,
        )
    return out[0, len(prompt_ids) :].tolist()


def near_tie_report(hf, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:
    """Score greedy outputs under a transformers model's own logits, step by step (teacher forcing):
    (fraction of steps where ours is its argmax, worst gap between its top logit and ours relative to
    its logit spread). Used for bf16, where kernels round differently and a sequence may take the
    other branch of a near-tie: each step is judged on its own."""
    steps = exact = 0
    worst = 0.0
    for p, out in zip(prompts, outputs):
        ids = torch.tensor([p + out], device=hf.device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : len(p) - 1 + len(out)].float()  # (n, vocab)
        chosen = logits.gather(1, torch.tensor(out, device=hf.device)[:, None]).squeeze(1)
        top = logits.max(dim=1).values
        gap = (top - chosen) / (top - logits.median(dim=1).values)
        worst = max(worst, gap.max().item())
        exact += int((gap == 0).sum())
        steps += len(out)
    return exact / steps, worst


@contextlib.contextmanager
def default_backend_runtime(**runtime_args):
    """A colocated DSL Runtime on the default model, set as the default backend while the block runs."""
    import plait as sgl

    rt = sgl.Runtime(**runtime_args)
    sgl.set_default_backend(rt)
    try:
        yield rt
    finally:
        sgl.set_default_backend(None)
        rt.shutdown()


@contextlib.contextmanager
def http_server_in_thread(engine):
    """The real HTTP app (uvicorn, a real socket on a free port) over `engine`, in a thread: yields its URL."""
    import uvicorn
    from plait.runtime.server.http_server import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the HTTP server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(log_path, *flags: str, startup_deadline_s: float = 600):
    """`python -m plait.runtime.server` in a subprocess on a free port, its output in `log_path`: yields
    its URL once /health answers; fails the test (with the log's tail) if it exits or never gets healthy."""
    import requests

    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait.runtime.server", "--port", str(port), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + startup_deadline_s
        try:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                try:
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        break
                except requests.ConnectionError:
                    pass
                if time.time() > deadline:
                    pytest.fail(f"server not healthy after {startup_deadline_s}s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_pid(url: str) -> int:
    """The `python -m plait.runtime.server --port PORT` process serving `url` (server_process yields only
    the URL): found by its command line, for tests that kill it or read its /proc."""
    from urllib.parse import urlparse

    port = str(urlparse(url).port).encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        if b"plait.runtime.server" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
            return int(entry)
    raise AssertionError(f"no server process listens on port {port!r}")


def server_info(url: str) -> dict:
    import requests

    return requests.get(url + "/get_server_info", timeout=30).json()


def wait_server_idle(url: str, deadline_s: float = 120) -> dict:
    """The server's info once no HTTP request is open and its scheduler has nothing to do (the deadline
    only guards against a hang)."""
    deadline = time.time() + deadline_s
    while True:
        info = server_info(url)
        if not (info["num_open_http_requests"] or info["num_running_reqs"] or info["num_waiting_reqs"]):
            return info
        assert time.time() < deadline, f"the server never went idle: {info}"
        time.sleep(0.1)
