"""Each served model's workers follow that model's lag alone (real supervisors, sleepers)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from core.kafka import TopicLag
from core.settings import Settings
from scheduler.model_fleet import ModelFleet, ServedModel

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _model(name: str, kind: str = "chat") -> ServedModel:
    return ServedModel(model=name, name=name, path=f"/m/{name}", kind=kind,
                       context_length=None, revision="r")


def test_each_models_workers_scale_by_its_own_lag() -> None:
    """Lag on `chat` alone starts chat workers; `emb` stays at its minimum."""
    settings = Settings(topic_prefix="bi", topic_partitions=3, autoscale_min_workers=0,
                        autoscale_max_workers=3, autoscale_lag_threshold=10,
                        autoscale_cooldown_s=0)
    fleet = ModelFleet([_model("chat"), _model("emb", "embedding")], num_workers=0)
    fleet.start(SLEEPER)
    lag = {"chat": 25, "emb": 0}

    def read_lag_of(name: str) -> Callable[[], Mapping[str, TopicLag]]:
        topics = settings.job_topics_for(name)
        return lambda: {topic: TopicLag(lag[name] if p == "normal" else 0, 3)
                        for p, topic in topics.items()}

    try:
        loops = fleet.autoscale_loops(settings, read_lag_of=read_lag_of)
        assert [loop.model for loop in loops] == ["chat", "emb"]
        assert [loop.step().num_workers for loop in loops] == [3, 0]  # ceil(25 / 10), emb 0
        fleet.apply_scaling()
        assert fleet.supervisors["chat"].num_running == 3
        assert fleet.supervisors["emb"].num_running == 0
        lag.update(chat=0, emb=15)
        assert [loop.step().num_workers for loop in loops] == [0, 2]
        fleet.apply_scaling()
        assert fleet.supervisors["emb"].num_running == 2
        assert fleet.supervisors["chat"].num_desired == 0
    finally:
        fleet.stop()
    # Worker processes know their model from the environment the fleet gives them.
    assert fleet.supervisors["emb"].env is not None
    assert fleet.supervisors["emb"].env["BATCHINFER_SERVED_MODEL_NAME"] == "emb"
