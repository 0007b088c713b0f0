"""Several served models: topic and group names, CLI pairing, settings, the fleet's env."""

from __future__ import annotations

import pytest

from cli.main import build_parser, served_models_of
from core.settings import Settings
from core.topics import PRIORITIES, job_topic_names, model_slug
from scheduler.autoscale_loop import LagReader
from scheduler.model_fleet import ServedModel, served_settings, worker_env


def test_slugs_keep_readable_names_and_never_collide() -> None:
    """A Kafka-safe name stays as it is; others are cleaned and told apart by a hash."""
    assert model_slug("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert model_slug("all-MiniLM-L6-v2") == "all-MiniLM-L6-v2"
    path_slug = model_slug("/models/Llama 3/")
    assert path_slug.startswith("models-Llama-3-") and len(path_slug) == len("models-Llama-3-") + 8
    assert model_slug("org/m") != model_slug("org-m")
    assert model_slug("org/m") == model_slug("org/m")
    assert len(model_slug("x" * 1000)) <= 100
    with pytest.raises(ValueError, match="model name"):
        model_slug("")


def test_each_served_model_has_its_own_topics_and_group() -> None:
    """`<prefix>.jobs.<model>.<priority>` and `<prefix>.workers.<model>`, per served name."""
    settings = Settings(topic_prefix="bi", model="/m/tiny", served_model_name="tiny",
                        served_models=["tiny", "emb"])
    assert settings.job_topics == {p: f"bi.jobs.tiny.{p}" for p in PRIORITIES}
    assert settings.consumer_group == "bi.workers.tiny"
    assert settings.job_topics_for("emb") == job_topic_names("bi", "emb")
    assert set(settings.job_topics_for("emb").values()).isdisjoint(settings.job_topics.values())
    assert settings.consumer_group_for("emb") == "bi.workers.emb"
    reader = LagReader(settings, model="emb")
    assert reader.job_topics == settings.job_topics_for("emb")


def test_served_name_defaults_to_the_model() -> None:
    """Without a served name, the model is served as --model said it; the API accepts it."""
    settings = Settings(model="smollm2-135m-instruct")
    assert settings.served_model_name == "smollm2-135m-instruct"
    assert settings.served_models == ["smollm2-135m-instruct"]
    named = Settings(model="/models/x", served_model_name="x")
    assert named.served_models == ["x"]


def test_cli_binds_each_name_to_the_model_just_before_it() -> None:
    """--served-model-name names the --model right before it; a model without one keeps its
    own name, whatever the order of the others."""
    args = build_parser().parse_args(["up", "--model", "/m/a", "--model", "b",
                                      "--served-model-name", "bee"])
    assert served_models_of(args.served) == [("/m/a", "/m/a"), ("b", "bee")]
    args = build_parser().parse_args(["up", "--model", "/m/a", "--served-model-name", "a",
                                      "--model", "b"])
    assert served_models_of(args.served) == [("/m/a", "a"), ("b", "b")]
    assert served_models_of(build_parser().parse_args(["up"]).served) == []
    with pytest.raises(ValueError, match="given twice"):
        served_models_of([("/m/a", "same"), ("/m/b", "same")])
    worker = build_parser().parse_args(["worker", "--model", "/m/a", "--served-model-name", "a"])
    assert (worker.model, worker.served_model_name) == ("/m/a", "a")


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--served-model-name", "tiny", "--model", "/m/a"],
     "--served-model-name tiny names the --model just before it"),
    (["up", "--model", "/m/a", "--served-model-name", "a", "--served-model-name", "b"],
     "--model /m/a is already served as 'a'"),
])
def test_cli_refuses_a_name_without_its_model(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A name before any --model, or a second name for one model, is a usage error (exit 2)
    that says how to fix it, never a name silently given to another model."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_worker_refuses_a_name_without_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`worker --served-model-name` alone is an error naming the missing option."""
    from cli.main import main

    assert main(["worker", "--served-model-name", "a"]) == 2
    assert "add --model" in capsys.readouterr().err


def test_fleet_settings_and_worker_env() -> None:
    """The API learns every name and which embed; each worker its directory and name."""
    chat = ServedModel(model="smollm2", name="chat", path="/m/smol", kind="chat",
                       context_length=8192, revision="r1")
    emb = ServedModel(model="all-minilm-l6-v2", name="emb", path="/m/mini", kind="embedding",
                      context_length=256, revision="r2")
    values = served_settings([chat, emb])
    settings = Settings.model_validate(values)
    assert settings.served_models == ["chat", "emb"]
    assert settings.embedding_models == ["emb"]
    env = worker_env(emb)
    assert (env["BATCHINFER_MODEL"], env["BATCHINFER_SERVED_MODEL_NAME"]) == ("/m/mini", "emb")
    assert Settings(model=env["BATCHINFER_MODEL"],
                    served_model_name=env["BATCHINFER_SERVED_MODEL_NAME"]).job_topics == (
        settings.job_topics_for("emb"))
