"""Packed projection weights on this CPU: packed only where oneDNN can pack the dtype here
(bf16 needs AVX-512 or AVX-NE-CONVERT), and then equal to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine.model import linear_packed, pack_weight
from workers.engine.placement import should_pack_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_dtype_is_packed_only_where_this_cpu_can_run_it(dtype: torch.dtype) -> None:
    weight = torch.randn(96, 64).to(dtype)
    x = torch.randn(5, 64).to(dtype)
    if not should_pack_weights(torch.device("cpu"), dtype):
        # F.linear runs it instead: it must, whatever the CPU.
        assert F.linear(x, weight).shape == (5, 96)
        return
    packed = linear_packed(x, pack_weight(weight), None)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(packed.float(), F.linear(x, weight).float(),
                               rtol=tolerance, atol=tolerance)


def test_nothing_is_packed_off_the_cpu() -> None:
    assert not should_pack_weights(torch.device("cuda"), torch.float32)
