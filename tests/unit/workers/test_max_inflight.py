"""How many jobs a worker holds at once depends on the engine it runs."""

from __future__ import annotations

from core.settings import Settings
from workers.engine.embedding_engine import EmbeddingEngine
from workers.engine.embedding_runner import EmbeddingRunner
from workers.inference.worker import max_inflight


def test_an_embedding_worker_holds_more_jobs_than_a_generating_one() -> None:
    settings = Settings(worker_max_inflight=16, embedding_worker_max_inflight=512)
    encoder = EmbeddingEngine(EmbeddingRunner("all-minilm-l6-v2", device="cpu", streams=1))
    assert max_inflight(settings, encoder) == 512
    assert max_inflight(settings, object()) == 16
    assert Settings().embedding_worker_max_inflight > Settings().worker_max_inflight
