"""Worker start: seconds from launch until a worker's engine is built, a fresh interpreter
against a fork from the warm server (scheduler/warm_start), in one invocation.

    python -m bench.worker_start [--model DIR|NAME] [--starts 5]

Each start runs this module as a child (`start_module`, warm or not) that imports what a
worker imports, builds the engine on the model and prints the seconds since its launch and
its CPU seconds; the warm server is started (and its imports paid) before the first warm
start is timed, as `up` has it from its model check. Default model: a tiny random Llama.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scheduler.warm_start import start_module

PROBE = "bench.worker_start"


def child(model: str, launched_at: str, out: str) -> None:
    """In the started process: what a worker does before it serves, then the figures."""
    import resource

    import workers.inference.runner  # noqa: F401  (the worker's own imports)
    from workers.engine import LLM

    LLM(model, dtype="float32", device="cpu")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(json.dumps({"wall_s": time.time() - float(launched_at),
                                     "cpu_s": usage.ru_utime + usage.ru_stime}))


def _one(model: str, warm: bool, work: Path) -> dict[str, float]:
    out = work / f"start-{time.monotonic_ns()}.json"
    process = start_module(PROBE, ["--child", model, str(time.time()), str(out)],
                           log_path=work / "children.log", warm=warm, new_session=False)
    code = process.wait(600)
    if code != 0:
        raise SystemExit(f"a start failed (exit {code}):\n"
                         f"{(work / 'children.log').read_text()[-3000:]}")
    return dict(json.loads(out.read_text()))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or known name "
                        "(default: a tiny random-weight Llama)")
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="worker-start-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from tests.unit.engine.tiny_models import save_tiny_llama
            model = str(work / "tiny")
            save_tiny_llama(Path(model))
        _one(model, True, work)  # the server's own imports, as `up`'s model check pays them
        rows = {}
        for label, warm in (("fresh interpreter", False), ("warm fork", True)):
            runs = [_one(model, warm, work) for _ in range(args.starts)]
            rows[label] = (statistics.median(r["wall_s"] for r in runs),
                           statistics.median(r["cpu_s"] for r in runs))
    print(f"model: {model}; {args.starts} starts each, medians")
    for label, (wall, cpu) in rows.items():
        print(f"  {label:18s} {wall:6.2f} s to an engine, {cpu:6.2f} s of CPU")
    (cold_wall, cold_cpu), (warm_wall, warm_cpu) = rows.values()
    print(f"  warm / fresh: {warm_wall / cold_wall:.2f}x the time, "
          f"{warm_cpu / cold_cpu:.2f}x the CPU")


if __name__ == "__main__":
    main()
