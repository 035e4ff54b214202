"""The one off-thread helper: work on worker threads, outcomes on the UI thread."""

from __future__ import annotations

import threading
import time

from gui.worker import TaskRunner


def test_outcomes_arrive_on_the_ui_thread_newest_call_per_channel(qtbot):
    runner = TaskRunner(max_threads=2)
    release = threading.Event()
    done: list[tuple[str, object, int]] = []
    busy: list[bool] = []
    runner.busy_changed.connect(busy.append)
    worker_threads: list[int] = []

    def slow_search() -> str:
        worker_threads.append(threading.get_ident())
        release.wait(5)
        return "old answer"

    def report(kind: str):
        return lambda value: done.append((kind, value, threading.get_ident()))

    runner.run("search", slow_search, report("done"), report("error"))
    runner.run("search", lambda: "new answer", report("done"), report("error"))
    runner.run("listing", lambda: 1 / 0, report("done"), report("error"))
    qtbot.waitUntil(lambda: len(done) == 2, timeout=5000)
    assert runner.busy  # the superseded search still runs
    release.set()
    qtbot.waitUntil(lambda: not runner.busy, timeout=5000)
    assert runner.wait(1000)
    ui = threading.get_ident()
    assert sorted((k, v) for k, v, _ in done) == [
        ("done", "new answer"),
        ("error", "division by zero"),
    ]
    assert {t for _, _, t in done} == {ui} and worker_threads[0] != ui
    assert busy == [True, False]


def test_max_threads_bounds_the_calls_running_at_once(qtbot):
    runner = TaskRunner(max_threads=1, describe_error=lambda exc: f"failed: {exc!r}")
    running, most = [0], [0]
    lock = threading.Lock()

    def work() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    errors: list[str] = []
    for i in range(4):
        runner.run(f"call {i}", work, lambda _: None, errors.append)
    runner.run("bad", lambda: int("x"), lambda _: None, errors.append)
    qtbot.waitUntil(lambda: not runner.busy, timeout=5000)
    assert most[0] == 1
    assert errors == ["failed: ValueError(\"invalid literal for int() with base 10: 'x'\")"]
