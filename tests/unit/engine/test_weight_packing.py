"""Packed projection weights on this CPU: packed in the dtype oneDNN can run here (bf16 and
fp16 natively only with the CPU's instructions for them, else widened to fp32), and then
equal to F.linear in the model's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine.models.linear import linear_packed, pack_weight
from workers.engine.placement import packing_dtype

NATIVE = {
    torch.float32: True,
    torch.bfloat16: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    torch.float16: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_dtype_runs_packed_and_equals_f_linear(dtype: torch.dtype, bias: bool) -> None:
    packed_as = packing_dtype(torch.device("cpu"), dtype)
    assert packed_as == (dtype if NATIVE[dtype] else torch.float32)
    weight = torch.randn(96, 64).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    x = torch.randn(5, 64).to(dtype)

    out = linear_packed(x, pack_weight(weight, packed_as), b)

    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), F.linear(x, weight, b).float(),
                               rtol=tolerance, atol=tolerance)


def test_a_widened_product_is_the_exact_product_rounded_once() -> None:
    # bf16 inputs widen exactly, so the fp32 product rounded to bf16 is what a bf16 GEMM
    # accumulating in fp32 returns, up to summation order: within one bf16 step.
    weight = torch.randn(256, 512).bfloat16()
    x = torch.randn(7, 512).bfloat16()
    exact = (x.double() @ weight.double().T).float()

    out = linear_packed(x, pack_weight(weight, torch.float32), None)

    assert out.dtype == torch.bfloat16
    step = exact.abs() * 2.0**-7 + 1e-6
    assert ((out.float() - exact).abs() <= step).all()


def test_nothing_is_packed_off_the_cpu() -> None:
    assert packing_dtype(torch.device("cuda"), torch.float32) is None
    assert packing_dtype(torch.device("cuda"), torch.bfloat16) is None
