"""A polled snapshot: timer readers never wait, a tight loop is paced by the publisher."""

from __future__ import annotations

import threading

from engine.published import Published


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def read_in_thread(board: Published, reads: int) -> tuple[threading.Thread, list]:
    got: list = []

    def reader() -> None:
        for _ in range(reads):
            got.append(board.read())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    return thread, got


def test_a_repeat_read_of_the_same_value_waits_for_the_next_publish():
    clock = Clock()
    board: Published[str] = Published(repeat_s=60.0, clock=clock)
    board.publish("v1")
    thread, got = read_in_thread(board, 2)
    thread.join(0.5)
    assert thread.is_alive(), "a poll at once for the value it has should wait"
    assert got == ["v1"]
    board.publish("v2")
    thread.join(5)
    assert not thread.is_alive()
    assert got == ["v1", "v2"]


def test_a_reader_on_a_timer_never_waits():
    clock = Clock()
    board: Published[str] = Published(repeat_s=60.0, clock=clock)
    board.publish("v1")
    assert board.read() == "v1"
    clock.now += 0.05  # a 20 Hz timer
    thread, got = read_in_thread(board, 1)
    thread.join(5)
    # Another thread's first read does not wait either.
    assert got == ["v1"] and not thread.is_alive()
    assert board.read() == "v1"  # this thread's last read was 50 ms ago


def test_a_new_value_is_returned_at_once():
    board: Published[int] = Published(repeat_s=60.0, clock=Clock())
    assert board.read() is None
    for value in range(5):
        board.publish(value)
        assert board.read() == value


def test_a_paced_read_still_returns_after_repeat_s_without_a_publish():
    board: Published[str] = Published(repeat_s=0.01, clock=Clock())
    board.publish("v1")
    thread, got = read_in_thread(board, 3)
    thread.join(5)
    assert got == ["v1"] * 3 and not thread.is_alive()
