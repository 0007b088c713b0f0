"""The fused CPU pointwise kernels against the eager torch formulas they replace."""

from __future__ import annotations

import pytest
import torch

from workers.engine import cpu_kernels
from workers.engine.models.norm import RMSNorm
from workers.engine.models.rotary import RotaryEmbedding
from workers.engine.pointwise import CPU_POINTWISE, TORCH_POINTWISE

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is not None, reason=f"CPU kernels unavailable: {cpu_kernels.load()}"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few ulps (exp, sqrt and the order of sums may differ); half types: one
    rounding step of the type."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    """Rows of a wider buffer too (the gate/up projection's output may be a view)."""
    wide = (torch.randn(rows, 2 * 1536 + 64) * 4).to(dtype)
    x = wide[:, 64:]
    close(CPU_POINTWISE.silu_and_mul(x), TORCH_POINTWISE.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotated", [64, 48])
def test_rotary_in_place_matches_the_formula(dtype: torch.dtype, rotated: int) -> None:
    """q and k heads of a strided q/k/v buffer, rotated where they lie; v untouched. With
    48 of 64 dimensions (partial rotary) the last 16 of each head pass through."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated))
    rotary = RotaryEmbedding(inv_freq, 2048)
    rotary.reset_table(torch.device("cpu"), dtype)
    positions = torch.tensor([0, 1, 5, 2047, 300, 300])
    qkv = torch.randn(6, (9 + 3 + 3) * 64).to(dtype)
    qk = qkv[:, : 12 * 64].view(6, 12, 64)
    v_before = qkv[:, 12 * 64 :].clone()
    before = qk.clone()
    want = TORCH_POINTWISE.rotate(qk, rotary(positions, TORCH_POINTWISE))
    got = CPU_POINTWISE.rotate(qk, rotary(positions, CPU_POINTWISE))
    assert got.data_ptr() == qk.data_ptr()
    close(got, want)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)
    assert torch.equal(got[..., rotated:], before[..., rotated:])
    assert not torch.equal(got[1:, :, :rotated], before[1:, :, :rotated])
    with pytest.raises(RuntimeError, match="position 2048 is outside the rotary table"):
        CPU_POINTWISE.rotate(qk, rotary(torch.full((6,), 2048), CPU_POINTWISE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype: torch.dtype, with_delta: bool) -> None:
    """The normalised sum and the sum itself, which the kernel leaves in `residual`."""
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    residual = (torch.randn(33, 576) * 3).to(dtype)
    delta = torch.randn(33, 576).to(dtype) if with_delta else None
    want_out, want_sum = TORCH_POINTWISE.add_rms_norm(norm, delta, residual.clone())
    got_out, got_sum = CPU_POINTWISE.add_rms_norm(norm, delta, residual)
    assert got_sum.data_ptr() == residual.data_ptr()
    assert torch.equal(got_sum, want_sum)  # one rounded add, exactly as torch's
    close(got_out, want_out)


def test_bad_arguments_are_refused() -> None:
    """Shapes and dtypes the kernels cannot read are errors, never stray reads."""
    ops = torch.ops.batchinfer_cpu
    with pytest.raises(RuntimeError, match="x must be"):
        ops.silu_and_mul(torch.empty(2, 3), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.silu_and_mul(torch.empty(2, 3, dtype=torch.bfloat16), torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="positions must be"):
        ops.rotary_embedding(torch.randn(2, 3, 8), torch.zeros(2, dtype=torch.int32),
                             torch.randn(10, 16))
    for width in (6, 20):  # not [cos|cos|-sin|sin] of an even count; wider than a head
        with pytest.raises(RuntimeError, match="table must be"):
            ops.rotary_embedding(torch.randn(2, 3, 8), torch.zeros(2, dtype=torch.int64),
                                 torch.randn(10, width))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(torch.empty(2, 8), torch.randn(2, 8), None, torch.ones(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="delta must be"):
        ops.add_rms_norm(torch.empty(2, 8), torch.randn(2, 8), torch.randn(3, 8), torch.ones(8),
                         1e-5)
