"""`--engine-url` on `up` (bound to the --model before it) and on `worker`."""

from __future__ import annotations

import pytest

from core.cli import build_parser, cmd_worker, engine_urls_of, served_models_of


def test_up_binds_each_engine_url_to_the_model_before_it() -> None:
    args = build_parser().parse_args([
        "up", "--model", "big", "--engine-url", "http://a:8000/v1", "--engine-url",
        "http://b:8000/v1", "--model", "small", "--model", "other", "--served-model-name",
        "big-name", "--engine-url", "http://c:8000/v1"])
    served = served_models_of(args.model, args.served_model_name)
    # --served-model-name pairs by position too: "big-name" names "big"
    assert engine_urls_of(served, args.engine_url) == {
        "big-name": ["http://a:8000/v1", "http://b:8000/v1"], "other": ["http://c:8000/v1"]}


def test_up_refuses_an_engine_url_before_any_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--engine-url", "http://a:8000/v1"])
    assert "give --model first" in capsys.readouterr().err


def test_worker_needs_the_model_its_servers_serve() -> None:
    args = build_parser().parse_args(["worker", "--engine-url", "http://a:8000/v1"])
    with pytest.raises(ValueError, match="add --model"):
        cmd_worker(args)
