"""Telemetry: step records, ring buffers, rates, events, threads."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from engine.cache import CacheStats
from engine.telemetry import SERIES, StepRecord, Telemetry


def _step(t: float, **kw) -> StepRecord:
    return StepRecord(time=t, **kw)


def test_empty_telemetry_reads_zeros():
    tel = Telemetry()
    assert len(tel) == 0 and tel.version == 0 and tel.latest() is None
    times, values = tel.series("decode_tokens")
    assert times.shape == values.shape == (0,)
    assert tel.prefill_tokens_per_s() == 0.0 and tel.decode_tokens_per_s() == 0.0
    assert tel.events() == []


def test_step_record_carries_the_cache_stats():
    stats = CacheStats(1, 2, 3, 4, 5, 0.25, 0.5, 0.75)
    rec = StepRecord.of(7.0, stats, prefill_tokens=10, decode_tokens=3, batch_size=2)
    assert (rec.time, rec.prefill_tokens, rec.decode_tokens, rec.batch_size) == (7.0, 10, 3, 2)
    assert rec.queue_depth == 0
    assert (rec.pages_host, rec.waste, rec.prefix_hit_rate) == (4, 0.25, 0.75)
    tel = Telemetry()
    tel.record(rec)
    for name in SERIES:
        _, values = tel.series(name)
        assert values.tolist() == [getattr(rec, name)], name
    assert tel.series("waste")[1].dtype == np.float64
    assert tel.series("batch_size")[1].dtype == np.int64


def test_ring_buffer_keeps_the_last_history_records_in_order():
    tel = Telemetry(history=5)
    for i in range(3):
        tel.record(_step(float(i), decode_tokens=10 * i))
    times, values = tel.series("decode_tokens")
    assert times.tolist() == [0.0, 1.0, 2.0] and values.tolist() == [0, 10, 20]
    for i in range(3, 5):  # exactly full: the write position is back at 0
        tel.record(_step(float(i), decode_tokens=10 * i))
    assert tel.series("decode_tokens")[1].tolist() == [0, 10, 20, 30, 40]
    for i in range(5, 12):
        tel.record(_step(float(i), decode_tokens=10 * i))
    times, values = tel.series("decode_tokens")
    assert times.tolist() == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert values.tolist() == [70, 80, 90, 100, 110]
    assert len(tel) == 5 and tel.version == 12
    latest = tel.latest()
    assert latest is not None and latest.time == 11.0 and latest.decode_tokens == 110


def test_reads_are_copies_and_bad_input_is_refused():
    tel = Telemetry(history=4)
    tel.record(_step(1.0, batch_size=3))
    times, values = tel.series("batch_size")
    values[0] = 99
    times[0] = -1.0
    assert tel.series("batch_size")[1].tolist() == [3]
    assert tel.series("batch_size")[0].tolist() == [1.0]
    with pytest.raises(KeyError):
        tel.series("time")
    with pytest.raises(ValueError):
        tel.record(_step(0.5))  # earlier than the last step
    assert tel.version == 1
    with pytest.raises(ValueError):
        Telemetry(history=0)


def test_version_counts_records_only():
    tel = Telemetry()
    seen = tel.version
    tel.log("note")
    assert tel.version == seen
    tel.record(_step(0.0))
    tel.record(_step(0.0))  # equal times are allowed
    assert tel.version == seen + 2


def test_rates_over_a_trailing_window():
    tel = Telemetry()
    tel.record(_step(0.0, prefill_tokens=10, decode_tokens=4))
    assert tel.prefill_tokens_per_s() == 0.0  # one record: no span
    for i in range(1, 21):  # a step every 0.5 s up to t = 10
        tel.record(_step(0.5 * i, prefill_tokens=10, decode_tokens=4))
    # window [8, 10]: the step at 8.0 anchors it, the four after it count
    assert tel.prefill_tokens_per_s(2.0) == pytest.approx(40 / 2.0)
    assert tel.decode_tokens_per_s(2.0) == pytest.approx(16 / 2.0)
    assert tel.decode_tokens_per_s(1.0) == pytest.approx(8 / 1.0)
    # the window ending at `now`: still running at 10.5, idle once a window has passed
    assert tel.decode_tokens_per_s(2.0, now=10.5) == pytest.approx(12 / 2.0)
    assert tel.decode_tokens_per_s(2.0, now=13.0) == 0.0


def test_rates_with_uneven_and_slow_steps():
    tel = Telemetry()
    for t, n in [(0.0, 0), (1.0, 10), (1.5, 40), (2.0, 10)]:
        tel.record(_step(t, prefill_tokens=n))
    assert tel.prefill_tokens_per_s(1.0) == pytest.approx((40 + 10) / 1.0)
    assert tel.prefill_tokens_per_s(10.0) == pytest.approx(60 / 2.0)  # all history
    slow = Telemetry()
    for t in (0.0, 3.0, 6.0):  # steps longer than the window stretch the span
        slow.record(_step(t, decode_tokens=30))
    assert slow.decode_tokens_per_s(2.0) == pytest.approx(30 / 3.0)


def test_events_incremental_read_and_bound():
    clock = itertools.count(100)
    tel = Telemetry(max_events=3, clock=lambda: float(next(clock)))
    assert tel.log("admitted", job=1) == 0
    assert tel.log("evicted", page=4, pages=2) == 1
    first = tel.events()
    assert first == [
        {"seq": 0, "time": 100.0, "kind": "admitted", "job": 1},
        {"seq": 1, "time": 101.0, "kind": "evicted", "page": 4, "pages": 2},
    ]
    cursor = first[-1]["seq"] + 1
    assert tel.events(cursor) == []
    for job in range(2, 5):
        tel.log("admitted", job=job)
    new = tel.events(cursor)
    assert [e["seq"] for e in new] == [2, 3, 4] and [e["job"] for e in new] == [2, 3, 4]
    assert [e["seq"] for e in tel.events()] == [2, 3, 4]  # only three kept
    assert [e["seq"] for e in tel.events(4)] == [4]
    new[0]["job"] = 99
    assert tel.events(2)[0]["job"] == 2
    with pytest.raises(ValueError):
        tel.log("bad", seq=5)


def test_concurrent_writer_and_reader():
    tel = Telemetry(history=64)
    steps = 3000
    errors: list[BaseException] = []

    def write():
        try:
            for i in range(steps):
                tel.record(_step(i * 0.01, decode_tokens=i % 7, batch_size=i % 5))
                if i % 10 == 0:
                    tel.log("step", index=i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    def read():
        try:
            version, cursor = 0, 0
            while True:
                done = not writer.is_alive()
                v = tel.version
                assert v >= version
                version = v
                times, values = tel.series("decode_tokens")
                assert len(times) == len(values) <= 64
                assert np.all(np.diff(times) >= 0)
                tel.decode_tokens_per_s()
                for e in tel.events(cursor):
                    assert e["seq"] >= cursor
                    cursor = e["seq"] + 1
                if done:
                    return
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=write)
    reader = threading.Thread(target=read)
    writer.start()
    reader.start()
    writer.join()
    reader.join()
    assert not errors, errors
    assert tel.version == steps and len(tel) == 64
    times, values = tel.series("decode_tokens")
    expect = np.arange(steps - 64, steps)
    assert np.allclose(times, expect * 0.01) and values.tolist() == (expect % 7).tolist()
