"""The attention kernels (split-KV decode, extend, shared prefix) compiled for a Hopper GPU (sm_90) on this
machine: the interpreter runs them here (the other tests in this folder), but only a GPU's compiler rejects
what it cannot lower. Triton's wheel ships the compiler passes and ptxas, so the variants the engine launches
are compiled to cubins here, in a process of its own (the suite runs Triton in interpreter mode);
tests/helpers/compile_sm90.py lists them."""

import pytest
from helpers.hopper_compile import compile_for_hopper, ptxas_shipped


@pytest.mark.skipif(not ptxas_shipped(), reason="this Triton wheel has no NVIDIA backend with ptxas")
def test_attention_kernels_compile_for_hopper(tmp_path):
    ok, failed, output = compile_for_hopper(["attention"], tmp_path)
    assert not failed, output
    assert len(ok) == 24, output  # decode: 10 stage-1 variants, 4 of each merge; extend: 4; shared prefix: 2
