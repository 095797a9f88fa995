"""The FP8 decode matmuls (and the kernels that make their rows: the quantization alone, and fused after RMSNorm
or SiLU-and-mul) compiled for a Hopper GPU (sm_90) on this machine: the skinny matmul reading FP8 codes, and
the tensor-core decode matmul with bf16 rows and with FP8 rows (both operands on the FP8 tensor cores), at the
tiles the engine picks for 1-256 rows. The interpreter runs them here in float32 (the other tests in this
folder); only a GPU's compiler says whether an FP8 x FP8 dot of these layouts lowers."""

import pytest
from helpers.hopper_compile import compile_for_hopper, ptxas_shipped


@pytest.mark.skipif(not ptxas_shipped(), reason="this Triton wheel has no NVIDIA backend with ptxas")
def test_fp8_matmul_kernels_compile_for_hopper(tmp_path):
    ok, failed, output = compile_for_hopper(["matmul"], tmp_path)
    assert not failed, output
    # the FP8 skinny matmul; W8A16 at 16-256 rows; W8A8 at 64-256 rows; the rows' quantization, 3 variants;
    # RMSNorm to FP8 (with a residual, and with a static scale); SiLU-and-mul to FP8; the unit-scaled matmul's scales
    assert len(ok) == 15, output
