"""The inference worker role: Kafka priority topics → the engine → the database.

`python -m workers.inference` runs one worker; `run_worker(settings)` does the same in
process. See `workers.inference.worker` for the poll loop.
"""
