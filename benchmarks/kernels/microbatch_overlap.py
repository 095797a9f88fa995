"""Can a large decode step overlap its memory-bound attention with its compute-bound matmuls?

At offline's mean decode batch (~491 requests, ~689-token contexts, 8B) a step is ~11 ms of matmuls running
at the tensor cores' rate and ~11 ms of split-KV attention running at HBM bandwidth, one after the other.
Split into two half batches, one half's attention could run while the other half's MLP does. This
measures, in one process on the same requests, a CUDA graph of the model forward (logits included) as:

- full: the whole batch, one stream (what the engine runs above its largest CUDA graph);
- halves: the two halves one after the other on one stream (the cost of the split alone);
- streams: the two halves on two streams, nothing else tying them;
- pingpong: two streams, one layer at a time, half A's attention beside half B's MLP and then the other
  way round (events keep the two attentions apart);
- each two-stream variant again with the matmuls told to leave SMs free (torch's SM carveout, where
  cuBLAS honours it).

    python benchmarks/kernels/microbatch_overlap.py --model llama-3.1-8b --batch-size 492 --context 689
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common

from bench_common import save  # noqa: E402


def main() -> None:
    from plait.runtime.attention import create_attention_backend
    from plait.runtime.executor.model_runner import ModelRunner
    from plait.runtime.forward_batch import ForwardMode
    from plait.runtime.request import Req
    from plait.runtime.sampling_params import SamplingParams
    from plait.runtime.scheduler.batch import ScheduleBatch
    from plait.runtime.server_args import ServerArgs

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch-size", type=int, default=492)
    ap.add_argument("--context", type=int, default=689)
    ap.add_argument("--ragged", type=float, default=0.5, help="contexts uniform in context x [1 -+ SPREAD]")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--carveouts", type=int, nargs="*", default=[16, 32])
    args = ap.parse_args()
    bs, ctx = args.batch_size, args.context
    gen = torch.Generator().manual_seed(0)
    spread = int(ctx * args.ragged)
    lens = torch.randint(ctx - spread, ctx + spread + 1, (bs,), generator=gen).tolist()
    sa = ServerArgs(
        model_path=args.model,
        load_format="dummy",
        max_total_tokens=sum(lens) + 64 * bs + 64,
        max_running_requests=bs,
        disable_cuda_graph=True,
        context_length=max(lens) + 80,
    )
    mr = ModelRunner(sa, args.model)
    reqs = []
    for i in range(bs):
        r = Req(
            f"r{i}",
            torch.randint(100, 30000, (lens[i],), generator=gen).tolist(),
            SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True),
        )
        r.req_pool_idx = mr.req_to_token_pool.alloc()
        reqs.append(r)
    # The prompts' KV, in chunks of ~32 requests (one prefill of every prompt would hold GBs of activations).
    for lo in range(0, bs, 32):
        chunk, n = reqs[lo : lo + 32], lens[lo : lo + 32]
        out = mr.run(
            ScheduleBatch(ForwardMode.EXTEND, chunk, [0] * len(chunk), n, mr.allocator.alloc(sum(n))).to_step()
        )
        for r, k, tok in zip(chunk, n, out.next_token_ids):
            r.output_ids, r.kv_len = [tok], k

    def decode_batch(rs, backend):
        fb = mr.forward.batch(
            ScheduleBatch(ForwardMode.DECODE, rs, out_cache_loc=mr.allocator.alloc(len(rs))).to_step()
        )
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        return fb

    model = mr.model
    backend_b = create_attention_backend(sa.resolved_attention_backend(), mr.attention)
    whole = decode_batch(reqs, mr.memory.attn_backend)
    half = bs // 2
    fa, fb_ = decode_batch(reqs[:half], mr.memory.attn_backend), decode_batch(reqs[half:], backend_b)
    sa_stream, sb_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def logits(f):
        return model.compute_logits(model(f.input_ids, f.positions, f))

    def full():
        logits(whole)

    def halves():
        logits(fa)
        logits(fb_)

    def streams():
        main = torch.cuda.current_stream()
        for s, f in ((sa_stream, fa), (sb_stream, fb_)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                logits(f)
        main.wait_stream(sa_stream)
        main.wait_stream(sb_stream)

    def attn_phase(layer, f, h, residual):
        if residual is None:
            residual, h = h, layer.input_layernorm(h)
        else:
            h, residual = layer.input_layernorm(h, residual)
        return layer.self_attn(f.positions, h, f), residual

    def mlp_phase(layer, h, residual):
        h, residual = layer.post_attention_layernorm(h, residual)
        return layer.mlp(h), residual

    def pingpong():
        main = torch.cuda.current_stream()
        sa_stream.wait_stream(main)
        sb_stream.wait_stream(main)
        with torch.cuda.stream(sa_stream):
            ha, ra = model.embed_tokens(fa.input_ids), None
        with torch.cuda.stream(sb_stream):
            hb, rb = model.embed_tokens(fb_.input_ids), None
        for layer in model.layers:
            a_done, b_done = torch.cuda.Event(), torch.cuda.Event()
            with torch.cuda.stream(sa_stream):
                ha, ra = attn_phase(layer, fa, ha, ra)
                a_done.record()
                ha, ra = mlp_phase(layer, ha, ra)  # beside B's attention
            with torch.cuda.stream(sb_stream):
                sb_stream.wait_event(a_done)  # B's attention after A's: each attention beside a MLP
                hb, rb = attn_phase(layer, fb_, hb, rb)
                b_done.record()
                hb, rb = mlp_phase(layer, hb, rb)
            sa_stream.wait_event(b_done)  # A's next attention after B's
        with torch.cuda.stream(sa_stream):
            model.compute_logits(model.norm(ha, ra)[0])
        with torch.cuda.stream(sb_stream):
            model.compute_logits(model.norm(hb, rb)[0])
        main.wait_stream(sa_stream)
        main.wait_stream(sb_stream)

    def timed(fn):
        # Replays of a CUDA graph of fn (the streams' fork and join captured as graph branches): the eager
        # forward is bound by the host's launches at these sizes, which would hide any overlap on the GPU.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        del graph
        return statistics.median(ms)

    gate_up = model.layers[0].mlp.gate_up_proj
    x_half = torch.randn(half, gate_up.weight.shape[1], dtype=gate_up.weight.dtype, device=gate_up.weight.device)

    def matmul_alone():  # does the carveout reach cuBLAS? (a compute-bound matmul slows if it does)
        for _ in range(8):
            gate_up(x_half)

    results = {}
    for _ in range(2):  # twice round, alternating: this machine's clocks drift under load
        for name, fn in (
            ("gate_up x8 alone", matmul_alone),
            ("full", full),
            ("halves", halves),
            ("streams", streams),
            ("pingpong", pingpong),
        ):
            results.setdefault(name, []).append(timed(fn))
        for c in args.carveouts:
            torch._C._set_sm_carveout_experimental(c)
            for name, fn in (
                ("gate_up x8 alone", matmul_alone),
                ("streams", streams),
                ("pingpong", pingpong),
                ("full", full),
            ):
                results.setdefault(f"{name} carveout {c}", []).append(timed(fn))
            torch._C._set_sm_carveout_experimental(None)
    base = min(results["full"])
    print(f"{args.model} decode forward, bs {bs}, contexts {ctx} +-{spread} (CUDA graph replays, logits included), ms:")
    for name, ms in results.items():
        print(f"  {name:24s} {' '.join(f'{m:8.3f}' for m in ms)}   best {min(ms) / base:.3f}x of full")
    save(f"microbatch_overlap_{args.model}_bs{bs}", {"results_ms": results, "lens": lens})


if __name__ == "__main__":
    with torch.inference_mode():
        main()
