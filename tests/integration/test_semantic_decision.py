"""The semantic cache's decision end to end in real Redis: a worker's lookup (segments,
MiniLM, the exact-scan backend, the verifier) on conversations and questions.

What a first job asked is remembered; each later job is answered from it or not. The
labelled set (tests/data/semantic_pairs.jsonl) measures the rates; this checks the
wiring: conversations compared by their last turn, long contexts, the scope of the
system prompt, and both knobs.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from core.messages import JobMessage
from storage.semantic_exact import ExactSemanticCache
from workers.engine.config import DEFAULT_MODELS_DIR
from workers.inference.semantic_lookup import SemanticLookup

LONG_SYSTEM = "You answer travel questions for a booking service, politely. " * 40


def chat(last: str, *, earlier: str = "I'm planning a trip to Portugal.",
         system: str = "Be brief.", **cache: Any) -> JobMessage:
    """A chat job: a system prompt, one earlier exchange, the last user turn."""
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": earlier},
                         {"role": "assistant", "content": "Lovely, how can I help?"},
                         {"role": "user", "content": last}],
            "temperature": 0, "max_tokens": 16, "cache": {"mode": "semantic", **cache}}
    return JobMessage(job_id=uuid.uuid4().hex, tenant_id="acme", priority="normal",
                      model="m", kind="chat.completion", body=body)


@pytest.fixture(scope="module")
def lookup(redis_url: str) -> SemanticLookup:
    """A worker's semantic lookup over the test Redis (MiniLM loaded once per module)."""
    cache = ExactSemanticCache(redis.Redis.from_url(redis_url),
                               prefix=f"t{uuid.uuid4().hex[:8]}")
    return SemanticLookup(cache, models_dir=DEFAULT_MODELS_DIR, revision=None,
                          default_ttl_s=600)


def answered(lookup: SemanticLookup, job: JobMessage) -> JobMessage:
    """Ask `job` (a miss) and remember an answer for it."""
    assert lookup.find([job]) == {}
    lookup.remember_many([(job, {"text": f"answer of {job.job_id}"})])
    return job


def served_by(lookup: SemanticLookup, job: JobMessage) -> str | None:
    """The job id whose answer `job` gets, or None."""
    hit = lookup.find([job]).get(job.job_id)
    lookup.forget(job.job_id)
    if hit is not None:
        assert hit.result == {"text": f"answer of {hit.job_id}"}  # the answer, unwrapped
    return None if hit is None else hit.job_id


def test_a_conversation_hits_on_its_last_turn_and_misses_when_it_changes(
        lookup: SemanticLookup) -> None:
    first = answered(lookup, chat("Do I need a visa to visit Portugal as a US citizen?"))
    assert served_by(lookup, chat("Do I need a visa to visit Portugal as a US citizen?!")) \
        == first.job_id
    assert served_by(lookup, chat("Do I need a visa to visit Spain as a US citizen?")) is None
    assert served_by(lookup, chat("Do I need a visa to visit Portugal as a US citizen?",
                                  earlier="I'm planning a trip to Japan.")) is None
    assert served_by(lookup, chat("Do I need a visa to visit Portugal as a US citizen?",
                                  system="Answer in French.")) is None  # another scope


def test_a_long_context_never_hides_the_last_turn(lookup: SemanticLookup) -> None:
    """Role-tagged and embedded whole, these two were one vector: the system prompt alone
    fills MiniLM's 256 word pieces."""
    first = answered(lookup, chat("What is the baggage allowance on my flight?",
                                  system=LONG_SYSTEM))
    assert served_by(lookup, chat("what is the baggage allowance on my flight",
                                  system=LONG_SYSTEM)) == first.job_id
    assert served_by(lookup, chat("Can I change the date of my flight?",
                                  system=LONG_SYSTEM)) is None


def test_max_error_and_threshold_set_how_near_is_near(lookup: SemanticLookup) -> None:
    first = answered(lookup, chat("How long is the train from Lisbon to Porto?"))
    near = "How long does the train from Lisbon to Porto take?"
    # Nothing certifies 0.005 with the shipped calibration: only exact answers then.
    assert served_by(lookup, chat(near, max_error=0.005)) is None
    assert served_by(lookup, chat(near, threshold=0.8)) == first.job_id
    assert served_by(lookup, chat("How long is the train from Porto to Lisbon?",
                                  threshold=0.8)) is None  # the checks hold under a threshold
