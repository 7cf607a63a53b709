"""Connector lifecycle: construction starts no thread (every field exists before one runs),
start() starts them, close() stops them; the factory hands the engine started workers."""

from __future__ import annotations

import threading

import pytest

from disagg.kv.pull import PullWorker
from disagg.kv.push import PushWorker
from tests.kv.fakes import make_worker


def _threads_of(worker: PullWorker | PushWorker) -> list[threading.Thread | None]:
    if isinstance(worker, PullWorker):
        return [worker._listener, worker.reader._thread]
    return [worker._listener, worker.writer._thread]


@pytest.mark.parametrize(
    ("cls", "kv"),
    [
        (PullWorker, {"connector": "pull", "role": "decode", "pull_setup": "background"}),
        (PushWorker, {"connector": "push", "role": "prefill"}),
        (PushWorker, {"connector": "push", "role": "decode"}),
    ],
)
def test_threads_run_from_start_to_close(cls: type, kv: dict[str, str]) -> None:
    worker, _buffer = make_worker(cls, **kv)
    try:
        assert not any(t is not None and t.is_alive() for t in _threads_of(worker))  # (1) built
        assert not worker.has_pending()  # callable before start(): its state exists
        worker.start()  # (2) started
        assert all(t is not None and t.is_alive() for t in _threads_of(worker))
    finally:
        worker.close()  # (3) closed
    for thread in _threads_of(worker):
        assert thread is not None
        thread.join(timeout=5)
        assert not thread.is_alive()
