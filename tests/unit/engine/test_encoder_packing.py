"""Encoders on oneDNN-packed projections: the same hidden states as transformers' own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel

from workers.engine.encoder_packing import PackedLinear, pack_encoder


def _bert(hidden_act: str) -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, hidden_act=hidden_act)
    return BertModel(config).eval()


def _hidden(model: BertModel) -> torch.Tensor:
    ids = torch.randint(5, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # a padded row
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize(("hidden_act", "fused"), [("gelu", True), ("gelu_new", False)])
def test_packed_projections_give_the_same_hidden_states(hidden_act: str, fused: bool) -> None:
    """Every projection packed (two layers of six, and the pooler); the exact GELU goes
    into its GEMM, the tanh approximation stays a module of its own."""
    model = _bert(hidden_act)
    expected = _hidden(model)
    assert pack_encoder(model, torch.device("cpu"), torch.float32) == 2 * 6 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    intermediate = model.get_submodule("encoder.layer.0.intermediate")
    assert isinstance(intermediate.dense, PackedLinear)
    assert isinstance(intermediate.intermediate_act_fn, nn.Identity) is fused
    torch.testing.assert_close(_hidden(model), expected, atol=2e-5, rtol=1e-4)


def test_nothing_is_packed_where_onednn_has_no_packing_for_the_device() -> None:
    """A CUDA model (cuBLAS needs no packing) is left exactly as it was."""
    model = _bert("gelu")
    assert pack_encoder(model, torch.device("cuda"), torch.float16) == 0
    assert type(model.get_submodule("encoder.layer.0.intermediate.dense")) is nn.Linear
