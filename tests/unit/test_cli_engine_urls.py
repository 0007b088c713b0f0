"""`--engine-url` on `up` (bound to the --model before it) and on `worker`, and the
engine options both pass on (`--kv-cache-dtype`)."""

from __future__ import annotations

import pytest

from cli.main import build_parser, cmd_worker, engine_urls_of, served_models_of


def test_up_binds_each_engine_url_to_the_model_before_it() -> None:
    args = build_parser().parse_args([
        "up", "--model", "big", "--engine-url", "http://a:8000/v1", "--engine-url",
        "http://b:8000/v1", "--model", "small", "--model", "other", "--served-model-name",
        "big-name", "--engine-url", "http://c:8000/v1"])
    served = served_models_of(args.served)
    # --served-model-name names the --model just before it: "other" is served as "big-name".
    assert served == [("big", "big"), ("small", "small"), ("other", "big-name")]
    assert engine_urls_of(served, args.engine_url) == {
        "big": ["http://a:8000/v1", "http://b:8000/v1"], "big-name": ["http://c:8000/v1"]}


def test_up_refuses_an_engine_url_before_any_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--engine-url", "http://a:8000/v1"])
    assert "give --model first" in capsys.readouterr().err


def test_worker_needs_the_model_its_servers_serve() -> None:
    args = build_parser().parse_args(["worker", "--engine-url", "http://a:8000/v1"])
    with pytest.raises(ValueError, match="add --model"):
        cmd_worker(args)


def test_kv_cache_dtype_reaches_the_engine_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-dtype fp8` on `worker` (and `up`) lands in the settings every process
    reads; a dtype the engine cannot store is refused by the parser."""
    import cli.main
    from core.settings import get_settings

    monkeypatch.delenv("BATCHINFER_ENGINE_KV_CACHE_DTYPE", raising=False)
    seen = []
    monkeypatch.setattr("workers.inference.run_worker",
                        lambda settings: seen.append(settings.engine_kv_cache_dtype))
    args = build_parser().parse_args(["worker", "--kv-cache-dtype", "fp8"])
    try:
        cli.main.cmd_worker(args)
    finally:
        monkeypatch.delenv("BATCHINFER_ENGINE_KV_CACHE_DTYPE", raising=False)
        get_settings.cache_clear()
    assert seen == ["fp8"]
    assert build_parser().parse_args(["up", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-cache-dtype", "int8"])
