#!/usr/bin/env bash
# One-shot check of the optional flashinfer attention backend on the GPU machine (no internet there).
#   device run, carry [".fi", ".whl"]:  bash benchmarks/tools/gpu_flashinfer_check.sh
# 1. installs the stripped flashinfer bundle from .fi/ (built here by make_flashinfer_bundle.sh) and
#    the plait dependencies from .whl/ into /tmp, 2. JIT-compiles the one FA2 module per head size
#    the tests need (bf16, head_dim 64 and 128; sm_90a only, 16 parallel jobs), 3. runs the GPU tests
#    of tests/attention/test_flashinfer_backend.py, 4. times decode attention (CUDA-graph replays, one layer)
#    flashinfer vs triton at the Llama-3.1-8B shape, bs 1/64/256 x ctx 512/4096, and prints a table
#    last (tri/fi > 1: flashinfer faster; also saved to $OUT/flashinfer_decode.json).
# About 4-5 minutes, most of it the JIT build. /tmp/fiws keeps the built modules while the machine is
# warm, so a second run skips the build.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/out}"; mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fisite \
  .fi/*.whl || { echo "installing .fi failed: build it (benchmarks/tools/make_flashinfer_bundle.sh), carry .fi"; exit 1; }
export PYTHONPATH=/tmp/fisite${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -c "import plait" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1

# FlashInfer's JIT: Hopper only (sm_90a), 16 compile jobs, sources and .so files under /tmp.
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 FLASHINFER_JIT_PREBUILD_MAX_JOBS=16
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin

stamp "import + JIT prebuild"
timeout 300 python3 - <<'EOF' 2>&1 | grep -vE "Warning|warn\(" | tail -8
import time

import torch

import flashinfer
from flashinfer.jit import build_jit_specs
from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module

print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
t = time.time()
# The module BatchPrefill/BatchDecode(use_tensor_cores) wrappers load for bf16, int32 indptr, no RoPE,
# window or soft cap: both head sizes in one ninja run.
bf16 = torch.bfloat16
specs = [_gen_batch_prefill_primary_module("fa2", bf16, bf16, bf16, torch.int32, d, d, 0, False, False, False)
         for d in (64, 128)]
build_jit_specs(specs)
print(f"JIT prebuild of {len(specs)} modules: {time.time() - t:.0f} s")
EOF

stamp "GPU tests"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 150 tests/attention/test_flashinfer_backend.py -s 2>&1 \
  | grep -vE "Warning|warn\(|^\s*$" | tee "$OUT/flashinfer_tests.log" | tail -15

stamp "decode attention timing"
timeout 90 python3 - "$OUT/flashinfer_decode.json" <<'EOF' 2>&1 | grep -vE "Warning|warn\("
import json
import sys
import time
import types

import torch

from plait.runtime.attention.base import AttentionLayerSpec
from plait.runtime.attention.flashinfer_backend import FlashInferAttnBackend
from plait.runtime.attention.triton_backend import TritonAttnBackend
from plait.runtime.forward_batch import ForwardBatch, ForwardMode
from plait.runtime.kvcache.memory_pool import KVPool, ReqToTokenPool

H, HKV, D = 32, 8, 128  # Llama-3.1-8B, one layer
layer = AttentionLayerSpec(0, H, HKV, D, D ** -0.5)
cfg = types.SimpleNamespace(num_attention_heads=H, num_key_value_heads=HKV, head_dim=D)


def graph_us(fn, reps=20, iters=10):
    """Device time of one call, from replays of a graph of `reps` calls (no launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(iters):
        graph.replay()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1000 / (iters * reps)


rows = []
for ctx in (512, 4096):
    for bs in (1, 64, 256):
        tokens = bs * ctx
        pool = KVPool(tokens, 1, HKV, D, torch.bfloat16, "cuda")
        pool.k_buffer[0].normal_()
        pool.v_buffer[0].normal_()
        r2t = ReqToTokenPool(bs + 1, ctx + 8, "cuda")
        # scattered slots, as in a pool that has served for a while
        r2t.req_to_token[1:bs + 1, :ctx] = (torch.randperm(tokens, device="cuda") + 1).view(bs, ctx).int()
        runner = types.SimpleNamespace(device="cuda", dtype=torch.bfloat16, max_total_tokens=tokens, model_config=cfg)
        q = torch.randn(bs, H, D, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * tokens * HKV * D * 2
        row = {"bs": bs, "ctx": ctx}
        outs = {}
        for name, cls in (("triton", TritonAttnBackend), ("flashinfer", FlashInferAttnBackend)):
            backend = cls(runner)
            backend.init_cuda_graph_state(bs)
            zeros = torch.zeros(bs, dtype=torch.int64, device="cuda")
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=zeros,
                positions=torch.full((bs,), ctx - 1, device="cuda"),
                req_pool_indices=torch.arange(1, bs + 1, device="cuda"), seq_lens=torch.full((bs,), ctx, device="cuda"),
                out_cache_loc=zeros, seq_lens_cpu=[ctx] * bs, req_to_token_pool=r2t, kv_pool=pool, attn_backend=backend)
            backend.init_forward_metadata_capture_cuda_graph(fb)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):  # per-step host work of a graph replay (flashinfer: page table + plan)
                backend.init_forward_metadata_replay_cuda_graph(fb)
            torch.cuda.synchronize()
            row[f"{name}_replay_meta_us"] = (time.perf_counter() - t) * 1e6 / 20
            row[f"{name}_us"] = graph_us(lambda: backend.forward_decode(q, layer, fb))
            row[f"{name}_GBps"] = kv_bytes / row[f"{name}_us"] / 1e3
            outs[name] = backend.forward_decode(q, layer, fb).float()
            del backend
        row["max_abs_diff"] = (outs["triton"] - outs["flashinfer"]).abs().max().item()
        rows.append(row)
        del pool, r2t
        torch.cuda.empty_cache()

json.dump({"gpu": torch.cuda.get_device_name(), "shape": "llama-3.1-8b one layer (32 q, 8 kv heads, d 128)",
           "rows": rows}, open(sys.argv[1], "w"), indent=1)
print(f"{'bs':>4} {'ctx':>5} | {'triton us':>9} {'GB/s':>6} | {'flashinfer us':>13} {'GB/s':>6} | {'tri/fi':>6} "
      f"| {'meta us tri/fi':>14} | {'max diff':>8}")
for r in rows:
    print(f"{r['bs']:>4} {r['ctx']:>5} | {r['triton_us']:>9.1f} {r['triton_GBps']:>6.0f} | {r['flashinfer_us']:>13.1f} "
          f"{r['flashinfer_GBps']:>6.0f} | {r['triton_us'] / r['flashinfer_us']:>6.2f} | "
          f"{r['triton_replay_meta_us']:>6.0f}/{r['flashinfer_replay_meta_us']:<7.0f} | {r['max_abs_diff']:>8.4f}")
EOF
stamp "done"
