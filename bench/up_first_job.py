"""`batchinfer up` to its first answered job: seconds to the API key and to the first job
done, with the worker's group join during its load and after it, in turn.

    python -m bench.up_first_job [--model DIR|NAME] [--starts 3]

Each start is a fresh `up` on its own data directory (one worker), timed from its launch;
the job is submitted as soon as the API key is printed, as a user pasting the README
would. Settings alternate between starts (BATCHINFER_WORKER_JOIN_WHILE_LOADING true,
false), so a drift in the machine's load falls on both. Default model: a tiny random
Llama (its load is short, so the join shows whole); SmolLM2's load hides most of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from scheduler.embedded_services import free_port
from tests.unit.engine.tiny_models import save_tiny_llama
from tests.utils.up_process import start_up, wait_for_status


def one_start(root: Path, model: str, join_while_loading: bool) -> dict[str, float]:
    """Seconds from launch to the API key and to the first job done."""
    root.mkdir(parents=True)
    launched = time.monotonic()
    up = start_up(root / "data", free_port(), num_workers=1, log_path=root / "up.log",
                  extra_env={"BATCHINFER_MODEL": model, "BATCHINFER_WORKER_JOIN_WHILE_LOADING":
                             str(join_while_loading).lower()})
    try:
        key_s = time.monotonic() - launched
        with up.client() as client:
            response = client.post("/v1/jobs", json={
                "model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hello."}]})
            response.raise_for_status()
            wait_for_status(client, response.json()["id"], "succeeded", 600)
        return {"key_s": key_s, "job_s": time.monotonic() - launched}
    finally:
        up.stop(timeout=120.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or known name "
                        "(default: a tiny random Llama)")
    parser.add_argument("--starts", type=int, default=3, help="starts of each setting")
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            model = str(root / "tiny")
            save_tiny_llama(Path(model))
        for i in range(args.starts):
            for join_while_loading in ((True, False) if i % 2 == 0 else (False, True)):
                figures = one_start(root / f"start-{i}-{join_while_loading}", model,
                                    join_while_loading)
                results[join_while_loading].append(figures)
                print(f"start {i + 1}, join while loading {join_while_loading}: API key "
                      f"{figures['key_s']:.1f} s, first job done {figures['job_s']:.1f} s",
                      flush=True)
    for join_while_loading, runs in results.items():
        print(f"join while loading {join_while_loading}: median API key "
              f"{statistics.median(r['key_s'] for r in runs):.1f} s, first job done "
              f"{statistics.median(r['job_s'] for r in runs):.1f} s ({len(runs)} starts)")


if __name__ == "__main__":
    main()
