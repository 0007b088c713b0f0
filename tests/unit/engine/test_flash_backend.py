"""FlashAttentionBackend on the CPU, through stand-ins for flash-attn's entry points.

The stand-ins (flash_standin.py) check arguments as flash-attn does and compute densely,
so these tests pin down what the backend passes: lengths, tables, layouts, which entry
point each kind of step uses, and that its decode path replays from a captured graph.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.engine import flash_standin, graph_emulator
from tests.unit.engine.flash_standin import FlashArgumentError
from tests.unit.engine.graph_checks import DecodeCase
from tests.unit.engine.test_attention import HEAD_DIM, HEADS, KV_HEADS, SHAPES, run_backend
from workers.engine import flash_attention
from workers.engine.flash_attention import FlashAttentionBackend

DECODES = [(0, 1), (7, 1), (255, 1), (256, 1), (300, 1)]
FRESH = [(0, 5), (0, 1), (0, 40)]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Install the stand-ins and record which entry point each step calls, with what."""
    flash_standin.install(monkeypatch)
    recorded: list[tuple[str, dict[str, Any]]] = []
    for name in ("flash_attn_with_kvcache", "flash_attn_varlen_func"):
        fn = getattr(flash_standin, name)

        def spy(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            recorded.append((_name, kwargs))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(flash_attention, name, spy)
    return recorded


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("shapes", "entry", "paged"),
    [
        (SHAPES, "flash_attn_varlen_func", True),
        (DECODES, "flash_attn_with_kvcache", True),
        (FRESH, "flash_attn_varlen_func", False),
    ],
    ids=["mixed", "decodes", "fresh-prefills"],
)
def test_flash_backend_matches_dense_attention(
    calls: list[tuple[str, dict[str, Any]]],
    dtype: torch.dtype,
    shapes: list[tuple[int, int]],
    entry: str,
    paged: bool,
) -> None:
    """Each step kind reaches its entry point; fresh prefills go without a block table."""
    backend = FlashAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    out, ref = run_backend(backend, 256, torch.device("cpu"), dtype, shapes)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert [name for name, _ in calls] == [entry]
    assert (calls[0][1].get("block_table") is not None) == paged


def test_flash_standin_refuses_what_flash_refuses(calls: list[Any]) -> None:
    """fp32 inputs and 16-token pages are errors in flash-attn, and so in the stand-in."""
    backend = FlashAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(FlashArgumentError, match="fp16 and bf16"):
        run_backend(backend, 256, torch.device("cpu"), torch.float32, SHAPES)
    with pytest.raises(FlashArgumentError, match="divisible by 256"):
        run_backend(backend, 16, torch.device("cpu"), torch.float16, SHAPES)


def test_flash_decode_graph_replays_bit_for_bit(
    calls: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replays equal the eager forward over the same buffers exactly, and the unpadded
    eager step within bf16 rounding, across batch sizes and block-table widths."""
    graph_emulator.install(monkeypatch)
    case = DecodeCase(
        FlashAttentionBackend, torch.bfloat16, 256, num_blocks=24, max_blocks_per_seq=3
    )
    case.graphs.capture()
    for round_, (batch_size, width) in enumerate([(1, 1), (3, 3), (8, 2), (5, 1)]):
        batch = case.decode_batch(batch_size, width, seed=round_)
        replayed = case.replay(batch)
        assert replayed.shape[0] == batch_size
        assert torch.equal(replayed, case.eager_on_graph_buffers(batch_size))
        torch.testing.assert_close(replayed, case.eager_step(batch), atol=3e-2, rtol=3e-2)
