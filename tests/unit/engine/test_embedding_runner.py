"""The embedding runner against plain transformers and sentence-transformers, all-MiniLM-L6-v2.

The reference pools as the model's sentence-transformers config says (mean over real
tokens, then L2 normalisation) on transformers' own padded, truncated batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from workers.engine.embedding_pooling import PoolingConfig, pool, read_pooling_config
from workers.engine.embedding_runner import MIN_SPLIT_TOKENS, EmbeddingRunner, batch_budget
from workers.engine.registry import resolve_model

LONG = "The quick brown fox jumps over the lazy dog. " * 120  # ~1,200 tokens
TEXTS = [
    "",
    " ",
    ".",
    "a",
    "Hello, world!",
    "Embeddings turn text into vectors that can be compared with a dot product.",
    LONG,
    "日本語の文章もベクトルになります。",
    "Привет, мир! Это проверка.",
    "مرحبا بالعالم",
    "emoji 🚀🔥 and accents: café naïve",
]


@pytest.fixture(scope="module")
def runner() -> EmbeddingRunner:
    """The packaged all-MiniLM-L6-v2 on the CPU in fp32."""
    return EmbeddingRunner("all-minilm-l6-v2", device="cpu")


def reference(texts: list[str]) -> torch.Tensor:
    """Mean pooling + normalisation over transformers' own padded, truncated batch."""
    model_dir = resolve_model("all-minilm-l6-v2", Path("."))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.nn.functional.normalize(mean, dim=-1)


def test_pooling_follows_the_sentence_transformers_config(runner: EmbeddingRunner) -> None:
    """all-MiniLM-L6-v2: mean pooling, normalised, 256 tokens, 384 dimensions."""
    assert read_pooling_config(runner.model_dir) == PoolingConfig("mean", True, 256)
    assert (runner.max_model_len, runner.dimensions) == (256, 384)


def test_embeddings_equal_the_reference_pooling(runner: EmbeddingRunner) -> None:
    """Cosine >= 0.9999 on empty-ish, long, non-Latin and emoji texts; unit length."""
    outputs = runner.embed(TEXTS)
    expected = reference(TEXTS)
    for text, output, want in zip(TEXTS, outputs, expected, strict=True):
        cosine = torch.nn.functional.cosine_similarity(output.embedding, want, dim=0).item()
        assert cosine >= 0.9999, (text[:40], cosine)
        assert abs(output.embedding.norm().item() - 1.0) < 1e-4
    # The long text is cut at the model's 256 tokens and says so; the others are whole.
    assert [o.is_truncated for o in outputs] == [t is LONG for t in TEXTS]
    assert outputs[TEXTS.index(LONG)].num_tokens == 256
    assert outputs[0].num_tokens == 2  # [CLS] [SEP]


def test_embeddings_equal_sentence_transformers(runner: EmbeddingRunner) -> None:
    """The same texts through sentence-transformers' own encode."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(runner.model_dir), device="cpu")
    expected = torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))
    got = torch.stack([o.embedding for o in runner.embed(TEXTS)])
    cosines = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosines.min().item() >= 0.9999


def test_token_ids_embed_like_their_text(runner: EmbeddingRunner) -> None:
    """A list of token ids is the text's tokens, wrapped in the same special tokens."""
    text = "Token ids are accepted as input."
    ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
    by_text, by_ids = runner.embed([text, ids])
    torch.testing.assert_close(by_text.embedding, by_ids.embedding)
    assert by_text.num_tokens == by_ids.num_tokens == len(ids) + 2


def test_small_token_budgets_give_the_same_vectors_in_input_order(
        runner: EmbeddingRunner) -> None:
    """Batches sorted by length and cut by the budget change nothing but speed."""
    texts = [f"sentence number {i} " * (1 + i % 7) for i in range(40)]
    whole = runner.embed(texts)
    runner.max_num_batched_tokens, budget = 256, runner.max_num_batched_tokens
    try:
        batches = runner.batches(runner.encode(texts))
        split = runner.embed(texts)
    finally:
        runner.max_num_batched_tokens = budget
    assert len(batches) > 1
    for batch in batches:
        widths = [len(e.token_ids) for e in batch]
        assert len(batch) * max(widths) <= 256
        assert widths == sorted(widths, reverse=True)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a.embedding, b.embedding, atol=1e-5, rtol=0)


def test_less_than_a_batch_per_stream_is_shared_by_the_streams() -> None:
    assert batch_budget(8192, 4096, streams=2) == 4096  # a full batch for each stream
    assert batch_budget(3000, 4096, streams=2) == 1500  # an even share
    assert batch_budget(3001, 4096, streams=3) == 1001
    assert batch_budget(600, 4096, streams=2) == MIN_SPLIT_TOKENS  # not smaller than that
    assert batch_budget(100, 256, streams=2) == 256  # nor larger than the budget
    assert batch_budget(3000, 4096, streams=1) == 4096  # one stream (a GPU) takes it all


def test_a_small_mixed_input_pads_little_and_runs_on_every_stream(
        runner: EmbeddingRunner) -> None:
    """A few long texts among short ones no longer pad the short ones to their length (a
    32-text request took ~1 s instead of ~0.2), and ~2,000 tokens go to both streams."""
    texts = [LONG, "short one", LONG, "a", "two words", "three short words"]
    batches = runner.batches(runner.encode(texts))
    assert [len(b) for b in batches] == [2, 4]
    for batch in batches:
        widths = [len(e.token_ids) for e in batch]
        assert max(widths) <= 2 * min(widths)
    even = [f"sentence {i} " + "word " * 30 for i in range(60)]  # ~36 tokens each
    encoded = runner.encode(even)
    num_tokens = sum(len(e.token_ids) for e in encoded)
    assert MIN_SPLIT_TOKENS * 2 < num_tokens < runner.max_num_batched_tokens
    two = EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=2)
    one = EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1)
    try:
        split = two.batches(encoded)
        assert len(split) >= 2
        first_width = len(split[0][0].token_ids)
        assert len(split[0]) * first_width <= -(-num_tokens // 2)
        assert len(one.batches(encoded)) == 1
        for a, b in zip(one.embed(texts + even), two.embed(texts + even), strict=True):
            torch.testing.assert_close(a.embedding, b.embedding, atol=1e-5, rtol=0)
    finally:
        two.close()


def test_streams_run_batches_side_by_side_with_the_same_vectors(
        runner: EmbeddingRunner) -> None:
    """Several single-threaded streams give one stream's vectors, in input order, and
    leave the caller's own thread count alone."""
    texts = [f"stream test {i} " * (1 + i % 9) for i in range(60)]
    threads = torch.get_num_threads()
    one = EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1,
                          max_num_batched_tokens=256)
    three = EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=3,
                            max_num_batched_tokens=256)
    try:
        assert one._pool is None and three.streams == 3
        assert len(three.batches(three.encode(texts))) > 3
        for a, b in zip(one.embed(texts), three.embed(texts), strict=True):
            torch.testing.assert_close(a.embedding, b.embedding, atol=1e-5, rtol=0)
        assert torch.get_num_threads() == threads
    finally:
        three.close()
    assert three._pool is None and len(three.embed(texts[:5])) == 5
    with pytest.raises(ValueError, match="streams must be >= 1, got 0"):
        EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=0)


def test_over_long_input_without_truncation_and_bad_ids_are_refused(
        runner: EmbeddingRunner) -> None:
    """Errors name the input's index, so a caller can point at the field."""
    with pytest.raises(ValueError, match=r"input\[1\] has \d+ tokens, more than the model's 256"):
        runner.embed(["short", LONG], truncate=False)
    with pytest.raises(ValueError, match=r"input\[0\] is an empty list"):
        runner.embed([[]])
    with pytest.raises(ValueError, match=r"input\[0\] holds token id 999999"):
        runner.embed([[5, 999999]])


def test_other_pooling_modes() -> None:
    """cls takes the first row, max the largest real value, lasttoken the last real row."""
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]]])  # (1, 3, 2); last is padding
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, PoolingConfig("cls")).tolist() == [[1.0, 0.0]]
    assert pool(hidden, mask, PoolingConfig("max")).tolist() == [[3.0, 4.0]]
    assert pool(hidden, mask, PoolingConfig("lasttoken")).tolist() == [[3.0, 4.0]]
    assert pool(hidden, mask, PoolingConfig("mean")).tolist() == [[2.0, 2.0]]
    torch.testing.assert_close(pool(hidden, mask, PoolingConfig("mean", normalize=True)),
                               torch.tensor([[2 ** -0.5, 2 ** -0.5]]))
    with pytest.raises(ValueError, match="pooling mode"):
        PoolingConfig("sum")
