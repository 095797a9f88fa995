"""Compile Triton kernels for a Hopper GPU (sm_90) on a machine without one: Triton's front end, its GPU
passes and ptxas (shipped in Triton's wheel) run on the CPU, so a kernel that only the interpreter ever ran
here still meets the compiler a GPU would use. Run as a script (Triton must not be in interpreter mode,
which the test suite's conftest sets) with the rooms to compile (`attention`, `lora`, `matmul`; default attention);
prints one line per variant, "ok NAME" or "FAILED NAME: error".

Arguments are typed from the kernels' naming convention: a capitalized argument is a pointer (fp32 unless
the variant's `pointers` names its dtype), `sm_scale*` a float, anything else an int32 (unless `pointers`
names its type: a float such as `eps`); constexprs as given.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def signature(kernel, constexprs: dict, pointers: dict) -> dict:
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name[0].isupper():
            sig[name] = pointers.get(name, "*fp32")
        elif name.startswith("sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_variant(kernel, constexprs: dict, pointers: dict, **options) -> None:
    source = ASTSource(kernel, signature(kernel, constexprs, pointers), constexprs)
    compiled = triton.compile(source, target=HOPPER, options=options)
    assert "cubin" in compiled.asm


def decode_attention_variants():
    """The split-KV decode's stage 1 and both merges, in every constexpr combination the engine launches."""
    stage1 = importlib.import_module("plait.runtime.attention.triton_ops.decode_attention")._decode_stage1_kernel
    merge = importlib.import_module("plait.runtime.attention.triton_ops.decode_merge")
    pointers = {
        "Q": "*bf16",
        "K_buf": "*bf16",
        "V_buf": "*bf16",
        "Out": "*bf16",
        "ReqToToken": "*i32",
        "ReqPoolIndices": "*i64",
        "SeqLens": "*i64",
        "ReqInfo": "*i32",
        "Splits": "*i32",
    }
    for items, prefix, direct, scaled in itertools.product((False, True), repeat=4):
        if direct and (prefix or items):  # stage 1 writes the output only with even splits and no prefix
            continue
        consts = dict(
            GROUP=4, HPP=2, HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16, BLOCK_N=32, MIN_SPLIT_LEN=32,
            DOT_PRECISION="tf32", HAS_PREFIX=prefix, ITEMS=items, DIRECT_OUT=direct, KV_SCALED=scaled, KV_F16=scaled,
            USE_PDL=False,
        )  # fmt: skip
        pool = dict(K_buf="*fp8e4nv", V_buf="*fp8e4nv") if scaled else {}
        name = f"decode stage 1 items={items} prefix={prefix} direct={direct} fp8={scaled}"
        yield name, stage1, consts, {**pointers, **pool}, dict(num_warps=4, num_stages=3)
    for items, prefix in itertools.product((False, True), repeat=2):
        common = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64 if items else 4, MIN_SPLIT_LEN=32, HAS_PREFIX=prefix,
                      ITEMS=items, BLOCK_P=4, USE_PDL=False)  # fmt: skip
        per_request = dict(common, NUM_HEADS=32, BLOCK_HQ=32)
        yield f"decode merge items={items} prefix={prefix}", merge._decode_stage2_kernel, per_request, pointers, {}
        per_head = dict(common, CHUNK_S=4)
        kernel = merge._decode_stage2_per_head_kernel
        yield f"decode per-head merge items={items} prefix={prefix}", kernel, per_head, pointers, {}


def extend_and_prefix_variants():
    """The extend (prefill, verify trees) and shared-prefix kernels at the 8B head shape, default tiles."""
    ops = importlib.import_module("plait.runtime.attention.triton_ops")
    extend = importlib.import_module("plait.runtime.attention.triton_ops.extend_attention")
    prefix = importlib.import_module("plait.runtime.attention.triton_ops.prefix_attention")
    cfg = ops.default_extend_config(128)
    for tree, scaled in itertools.product((False, True), repeat=2):
        pool = "*fp8e4nv" if scaled else "*bf16"
        pointers = dict(
            Q="*bf16",
            Out="*bf16",
            K_buf=pool,
            V_buf=pool,
            ReqToToken="*i32",
            ReqPoolIndices="*i64",
            PrefixLens="*i64",
            ExtendLens="*i64",
            ExtendStart="*i64",
            TreeLens="*i64",
            TreeMask="*u8",
            MaskOffsets="*i64",
        )
        tiles = dict(TOKENS=cfg.block_m // 4, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32", TREE=tree, KV_SCALED=scaled, **tiles)
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        yield f"extend tree={tree} fp8={scaled}", extend._extend_attention_kernel, consts, pointers, options
    pcfg = ops.PrefixConfig()
    for scaled in (False, True):
        pool = "*fp8e4nv" if scaled else "*bf16"
        tables = dict(Groups="*i32", Members="*i32", Work="*i32", WorkLen="*i32")
        pointers = dict(Q="*bf16", K_buf=pool, V_buf=pool, ReqToToken="*i32", **tables)
        tiles = dict(MEMBERS_PER_TILE=pcfg.members_per_tile(4), BLOCK_M=pcfg.rows_per_tile(4), BLOCK_N=pcfg.block_n)
        fields = dict(GROUP_FIELDS=prefix.GROUP_FIELDS, WORK_FIELDS=prefix.WORK_FIELDS)
        consts = dict(
            NUM_KV_HEADS=8,
            GROUP=4,
            HEAD_DIM=128,
            BLOCK_D=128,
            DOT_PRECISION="tf32",
            KV_SCALED=scaled,
            **tiles,
            **fields,
        )
        options = dict(num_warps=pcfg.num_warps, num_stages=pcfg.num_stages)
        yield f"shared prefix fp8={scaled}", prefix._prefix_attention_kernel, consts, pointers, options


def lora_variants():
    """The LoRA SGMV shrink and expand at Llama-3.1-8B's targets, rank 16, as a decode graph's one-row
    segments (32 requests) and as a prefill's runs (8 adapters x 64 rows), with the launch's own plan."""
    sgmv = importlib.import_module("plait.runtime.lora.sgmv")
    pointers = dict(X="*bf16", A="*bf16", B="*bf16", Y="*bf16", SegStart="*i64", SegLen="*i64", SegSlot="*i64")
    targets = {"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
    rank = 16
    for (target, (fan_in, outs)), (num_segs, longest) in itertools.product(targets.items(), ((32, 1), (8, 64))):
        K = rank * len(outs)
        splits, slice_in, block_in = sgmv.shrink_plan(num_segs, longest, fan_in, K, fan_out=sum(outs))
        one_row = longest == 1
        form = "one-row" if one_row else "runs"
        shrink = dict(IN=fan_in, K=K, SLICE_IN=slice_in, ONE_ROW=one_row, BLOCK_T=sgmv.BLOCK_T,
                      BLOCK_K=sgmv._block(K), BLOCK_IN=block_in)  # fmt: skip
        yield f"lora shrink {target} {form}", sgmv._shrink_kernel, shrink, pointers, {}
        ends = [sum(outs[: j + 1]) for j in range(len(outs))]
        ends += [ends[-1]] * (3 - len(ends))
        expand = dict(SPLITS=splits, SUBS=len(outs), END0=ends[0], END1=ends[1], END2=ends[2], K=K, R=rank,
                      BLOCK_R=sgmv._block(rank))  # fmt: skip
        options = {}
        if one_row:
            rows, block_n = sgmv.one_row_expand_grid(num_segs, sum(outs))
            expand.update(ROWS=rows, BLOCK_N=block_n, BLOCK_P=triton.next_power_of_2(splits))
            kernel = sgmv._expand_rows_kernel
        else:
            block_t, block_n = sgmv.run_expand_tile(longest)
            expand.update(BLOCK_T=block_t, BLOCK_N=block_n)
            options = dict(num_warps=sgmv.run_expand_warps(block_t, block_n))
            kernel = sgmv._expand_kernel
        yield f"lora expand {target} {form}", kernel, expand, pointers, options


def matmul_variants():
    """The decode matmuls with FP8 weights at Llama-3.1-8B's QKV (6,144 x 4,096): the skinny matmul reading FP8
    codes, and the tensor-core decode matmul with bf16 rows (FP8 widened in registers) and FP8 rows (both
    operands to the FP8 tensor cores), at the tiles `pick_fp8_gemm_config` takes for 1-256 rows; and the
    kernels that make those FP8 rows (the quantization alone, and fused after RMSNorm or SiLU-and-mul)."""
    gemv = importlib.import_module("plait.runtime.kernels.gemv")
    fp8 = importlib.import_module("plait.runtime.kernels.fp8_gemm")
    decode = importlib.import_module("plait.runtime.kernels.decode_gemm")
    n, k = 6144, 4096
    cfg = gemv.pick_gemv_config(n, k)
    consts = dict(HAS_BIAS=False, W_FP8=True, BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=False)
    ints = dict(M="i32", N="i32", K="i32")  # capitalized, yet not pointers
    pointers = dict(X="*bf16", W="*fp8e4nv", Scale="*fp32", B="*bf16", Y="*bf16", **ints)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    yield "gemv fp8 weights", gemv._gemv_kernel, consts, pointers, options
    for rows, x_fp8 in ((16, False), (64, False), (128, False), (256, False), (64, True), (128, True), (256, True)):
        cfg = fp8.pick_fp8_gemm_config(n, k, rows, x_fp8)
        consts = dict(HAS_BIAS=False, W_FP8=True, X_FP8=x_fp8, DOT_F32=False, BLOCK_M=rows, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k)  # fmt: skip
        pointers = dict(X="*fp8e4nv" if x_fp8 else "*bf16", XScale="*fp32", W="*fp8e4nv", Scale="*fp32", B="*bf16",
                        Y="*bf16", Partials="*fp32", Counters="*i32", K_PER_SPLIT="i32", SPLIT_K="i32",
                        **ints)  # fmt: skip
        options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        yield f"fp8 decode matmul rows={rows} x_fp8={x_fp8}", decode._decode_gemm_kernel, consts, pointers, options
    quant = importlib.import_module("plait.runtime.kernels.fp8_quant")
    pointers = dict(X="*bf16", Codes="*fp8e4nv", Scales="*fp32", StaticScale="*fp32", K="i32")
    variants = ((False, False, 4096, 8), (True, False, 16384, 16), (True, True, 4096, 8))
    for one_pass, mul_inverse, block, warps in variants:
        consts = dict(STATIC=False, MAX_CODE=448.0, MIN_AMAX=1e-12, BLOCK=block, ONE_PASS=one_pass,
                      MUL_INVERSE=mul_inverse)  # fmt: skip
        name = f"fp8 row quantization one_pass={one_pass} mul_inverse={mul_inverse} block={block}"
        yield name, quant._quantize_rows_kernel, consts, pointers, dict(num_warps=warps)
    # The norm and SiLU-and-mul writing those FP8 rows themselves, at the 8B widths (hidden 4,096, intermediate
    # 14,336) and the launches' own tiles: one row a program, the SiLU's row in chunks.
    acts = importlib.import_module("plait.runtime.kernels.fp8_activations")
    norm = importlib.import_module("plait.runtime.kernels.rmsnorm")
    block_d, block_rows, warps = norm.row_tiles(4096, 64)
    pointers = dict(X="*bf16", Residual="*bf16", W="*bf16", Codes="*fp8e4nv", Scales="*fp32", StaticScale="*fp32",
                    eps="fp32")  # fmt: skip
    for residual, static in ((True, False), (False, True)):
        consts = dict(DIM=4096, HAS_RESIDUAL=residual, ROUND_TO_X=True, STATIC=static, MAX_CODE=448.0, MIN_AMAX=1e-12,
                      BLOCK_ROWS=block_rows, BLOCK_D=block_d, USE_PDL=False)  # fmt: skip
        name = f"rmsnorm to fp8 residual={residual} static={static}"
        yield name, acts._rmsnorm_fp8_kernel, consts, pointers, dict(num_warps=warps)
    pointers = dict(GateUp="*bf16", Codes="*fp8e4nv", Scales="*fp32", StaticScale="*fp32")
    consts = dict(STATIC=False, MAX_CODE=448.0, MIN_AMAX=1e-12, BLOCK=acts.SILU_BLOCK, USE_PDL=False)
    yield "silu_and_mul to fp8", acts._silu_and_mul_fp8_kernel, consts, pointers, dict(num_warps=8)
    epilogue = importlib.import_module("plait.runtime.kernels.fp8_epilogue")
    pointers = dict(Y="*bf16", RowScale="*fp32", ColScale="*fp32", Bias="*bf16", Out="*bf16")
    consts = dict(HAS_BIAS=True, BLOCK=epilogue.MAX_BLOCK, USE_PDL=False)
    yield "unit-scaled FP8 matmul's scales", epilogue._scale_rows_cols_kernel, consts, pointers, dict(num_warps=8)


ROOMS = {
    "attention": (decode_attention_variants, extend_and_prefix_variants),
    "lora": (lora_variants,),
    "matmul": (matmul_variants,),
}


def main() -> int:
    rooms = sys.argv[1:] or ["attention"]
    failed = 0
    for name, kernel, constexprs, pointers, options in itertools.chain(*(v() for room in rooms for v in ROOMS[room])):
        try:
            compile_variant(kernel, constexprs, pointers, **{"num_warps": 4, **options})
            print(f"ok {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            failed += 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
