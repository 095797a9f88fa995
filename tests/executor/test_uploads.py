"""runtime/uploads.py on the CPU: what a static buffer receives, and a table too long for it refused by name.
(That the host does not wait for the device is checked on the GPU: tests/attention/test_cascade_attention.py,
tests/lora/test_lora_sgmv.py.)"""

from __future__ import annotations

import pytest
import torch
from plait.runtime.uploads import copy_into, to_device


def test_copy_into_fills_the_first_entries_and_refuses_an_overflow():
    dst = torch.full((6,), -1, dtype=torch.int32)
    out = copy_into(dst, torch.tensor([4, 5, 6], dtype=torch.int32))
    assert out.tolist() == [4, 5, 6] and dst.tolist() == [4, 5, 6, -1, -1, -1]
    with pytest.raises(ValueError, match="7 entries do not fit the static buffer of 6"):
        copy_into(dst, torch.zeros(7, dtype=torch.int32))


def test_to_device_on_the_cpu_is_the_host_tensor():
    host = torch.arange(5)
    assert to_device(host, "cpu") is host
