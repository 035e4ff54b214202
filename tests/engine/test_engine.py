"""The Engine facade: a background loop thread, thread-safe submit / cancel / snapshot,
events to handles and listeners, clean shutdown, errors that end jobs and not the thread."""

from __future__ import annotations

import io
import threading
import time

import pytest

from engine.cache.kv_cache import CacheSettings
from engine.cli.chat import page_map_text, run_chat
from engine.engine import Engine
from engine.generator.generator import GeneratorSettings
from engine.generator.job import EventKind, JobRequest
from engine.generator.sampler import SamplingSettings
from kernels.quant.matmul import DECODE_MAX_ROWS

GREEDY = SamplingSettings(temperature=0)
SYSTEM = "You are a helpful assistant who answers briefly and plainly, in one sentence only."


def _chat(question: str, **kwargs) -> JobRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return JobRequest(messages=messages, sampling=GREEDY, **kwargs)


@pytest.fixture
def engine(smollm2_int4):
    eng = Engine(
        smollm2_int4,
        CacheSettings(page_size=16, token_budget=2048),
        GeneratorSettings(max_batch_size=8),
    )
    eng.start()
    yield eng
    eng.shutdown()
    assert not eng.running


def test_concurrent_jobs_stream_and_finish(engine):
    seen: list = []
    engine.add_listener(seen.append)
    handles = [
        engine.submit(_chat(q, max_new_tokens=16))
        for q in ("Name a fruit.", "Name a tree.", "Name a bird.")
    ]
    for h in handles:
        events = list(h.events(timeout=120))
        assert events[0].kind is EventKind.STARTED and events[-1].eos
        streamed = "".join(e.text for e in events if e.kind is EventKind.STREAMING)
        assert streamed == h.result.text and h.result.new_tokens > 0
    # Later prompts found the shared system prompt's pages (the same job may have shared
    # them live, or found them cached).
    assert max(h.result.cached_tokens for h in handles) >= 16
    assert {e.job_id for e in seen if e.eos} == {h.job_id for h in handles}
    snap = _wait_idle(engine)
    assert snap.stats.pages_referenced == 0 and snap.stats.pages_cached > 0
    assert snap.stats.prefix_hit_rate > 0
    kinds = {e["kind"] for e in engine.telemetry.events()}
    assert {"job_started", "job_done", "page_stored"} <= kinds
    assert engine.telemetry.series("decode_tokens")[1].sum() == sum(
        h.result.new_tokens for h in handles
    )


def _wait_idle(engine, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if not snap.jobs and snap.stats.pages_referenced == 0:
            return snap
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


def test_snapshot_during_generation_shows_the_job(engine):
    handle = engine.submit(
        _chat("Write a long story about a lighthouse.", max_new_tokens=200, tag="chat-1")
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        running = [j for j in snap.jobs if j.job_id == handle.job_id and j.state == "decode"]
        if running:
            break
        time.sleep(0.01)
    assert running, "the snapshot never showed the job decoding"
    info = running[0]
    assert info.tag == "chat-1" and info.pages > 0
    owners = {o for owners in snap.cache.owners for o in owners}
    assert set(info.sequences) <= owners
    assert all(snap.seq_jobs[s] == handle.job_id for s in info.sequences)
    engine.cancel(handle.job_id)
    result = handle.wait(30)
    assert result.eos_reason == "cancelled"
    snap = _wait_idle(engine)
    assert not any(set(info.sequences) & set(o) for o in snap.cache.owners)


def test_bad_input_is_refused_and_the_engine_keeps_serving(engine):
    good = engine.submit(_chat("Say hello.", max_new_tokens=8))
    for bad, message in (
        (JobRequest(prompt=[]), "empty"),
        (JobRequest(prompt=[1, 2, 3], max_new_tokens=0), "max_new_tokens"),
        (JobRequest(prompt=[1, 2, 3], sampling=SamplingSettings(top_k=-3)), "top_k"),
        (JobRequest(prompt=list(range(1, 3000)), max_new_tokens=4), "pages"),
        (JobRequest(messages=[]), "empty"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.submit(bad)
    cancelled = engine.submit(_chat("Count to one hundred.", max_new_tokens=100))
    cancelled.cancel()
    assert cancelled.wait(30).eos_reason in ("cancelled", "stop_token", "max_new_tokens")
    assert good.wait(60).eos_reason in ("stop_token", "max_new_tokens")
    assert engine.running


def test_an_exception_in_the_loop_ends_jobs_not_the_thread(smollm2_int4, monkeypatch):
    eng = Engine(smollm2_int4, CacheSettings(page_size=16, token_budget=1024))
    calls = {"n": 0}
    real = eng.generator.decode

    def flaky(events):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom in the scheduler")
        return real(events)

    monkeypatch.setattr(eng.generator, "decode", flaky)
    with eng:
        first = eng.submit(_chat("Name a colour.", max_new_tokens=12))
        result = first.wait(60)
        assert result.eos_reason == "error" and "boom in the scheduler" in result.error
        assert "boom in the scheduler" in eng.loop_error
        second = eng.submit(_chat("Name a colour.", max_new_tokens=6))
        assert second.wait(60).eos_reason in ("stop_token", "max_new_tokens")
        eng.cache.pages.validate()


def test_shutdown_while_generating_cancels_and_joins(smollm2_int4):
    eng = Engine(smollm2_int4, CacheSettings(page_size=16, token_budget=1024)).start()
    handle = eng.submit(_chat("Tell me everything about rivers.", max_new_tokens=400))
    for event in handle.events(timeout=60):
        if event.kind is EventKind.STREAMING:
            break
    t0 = time.monotonic()
    eng.shutdown(timeout=30)
    assert time.monotonic() - t0 < 30
    assert handle.wait(1).eos_reason == "cancelled"
    assert not eng.running
    assert not eng.cache.pages.referenced
    with pytest.raises(RuntimeError):
        eng.submit(_chat("Hello?"))


def test_submit_from_many_threads(engine):
    handles = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        h = engine.submit(
            JobRequest(
                prompt=[1, 2, 3, 4 + i], sampling=GREEDY, max_new_tokens=5, stop_token_ids=()
            )
        )
        with lock:
            handles.append(h)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [h.wait(60) for h in handles]
    assert len({h.job_id for h in handles}) == 8
    assert all(len(r.token_ids[0]) == 5 for r in results)


def test_chat_cli_reuses_earlier_turns_and_prints_the_page_map(engine):
    out = io.StringIO()
    lines = [
        "What is a cat?\n",
        "/stats\n",
        "And a dog?\n",
        "/stats\n",
        "/reset\n",
        "/nonsense\n",
        "/quit\n",
    ]
    messages = run_chat(engine, lines, out, system=SYSTEM, sampling=GREEDY, max_new_tokens=24)
    text = out.getvalue()
    assert len(messages) == 1  # reset back to the system prompt
    stats = text.split("last reply: ")[1:]
    assert len(stats) == 2
    cached_second = int(stats[1].split(" = ")[1].split(" cached")[0])
    assert cached_second >= 32, "the second turn recomputed the first"
    assert "legend:" in text and "unknown command /nonsense" in text


def test_page_map_text_counts_pages(engine):
    snap = engine.snapshot()
    text = page_map_text(snap, width=32)
    rows = text.splitlines()
    cells = "".join(rows[: -(-snap.num_pages // 32)])
    assert len(cells) == snap.num_pages and set(cells) <= set(".#+ch")
    assert f"{snap.num_pages} pages x {snap.page_size} tokens" in text


def test_folio_chat_command(smollm2_path, monkeypatch, capsys):
    from folio.main import main

    monkeypatch.setattr("engine.cli.main.model_path", lambda arg: smollm2_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\n/stats\n/quit\n"))
    argv = ["chat", "--page-size", "16", "--cache-tokens", "1024", "--temperature", "0"]
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2" in out and "last reply: prompt" in out and "legend:" in out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.model.loader import load_model
    from tests.engine.tiny_models import make_hf_model, save_hf_folder

    folder = save_hf_folder(make_hf_model("qwen3", seed=5), tmp_path_factory.mktemp("tiny") / "m")
    return load_model(folder, load_tokenizer=False)


def _tiny_engine(loaded, **settings) -> Engine:
    return Engine(
        loaded, CacheSettings(page_size=16, token_budget=1024), GeneratorSettings(**settings)
    )


def _ids_request(seed: int, **kwargs) -> JobRequest:
    prompt = [(seed * 7 + i) % 300 + 1 for i in range(6)]
    return JobRequest(prompt=prompt, sampling=GREEDY, stop_token_ids=(), **kwargs)


def test_a_request_wider_than_the_batch_is_refused_at_submit(tiny):
    with _tiny_engine(tiny, max_batch_size=2) as engine:
        with pytest.raises(ValueError, match="batch holds 2: lower n / beam width"):
            engine.submit(_ids_request(0, max_new_tokens=4, n=3))
        with pytest.raises(ValueError, match="needs 5 sequences"):
            engine.submit(_ids_request(0, max_new_tokens=4, beam_width=5))
        # Nothing was queued, and jobs behind it run.
        handles = [engine.submit(_ids_request(i, max_new_tokens=4)) for i in range(6)]
        assert all(h.wait(60).new_tokens == 4 for h in handles)


def test_the_snapshot_says_where_the_pages_and_weights_are(tiny):
    # what the memory panel needs to draw a GPU's memory (gui/views/device_memory.py)
    with _tiny_engine(tiny) as engine:
        snap = engine.snapshot()
        assert snap.device == str(engine.cache.device) == "cpu"
        assert snap.weight_bytes == tiny.weight_bytes > 0
        assert snap.cache_bytes == engine.cache.nbytes()


def test_submit_after_shutdown_raises(tiny):
    engine = _tiny_engine(tiny).start()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(_ids_request(0, max_new_tokens=4))


def test_a_submit_caught_between_check_and_queue_by_shutdown_still_finishes(tiny, monkeypatch):
    """The window the race used to hit, held open: shutdown runs while a submit is
    preparing its job. That submit is refused, or its handle finishes."""
    engine = _tiny_engine(tiny).start()
    entered, go = threading.Event(), threading.Event()
    prepare = engine.generator.prepare

    def slow_prepare(request):
        entered.set()
        go.wait(10)
        return prepare(request)

    monkeypatch.setattr(engine.generator, "prepare", slow_prepare)
    outcome: list = []

    def submit():
        try:
            outcome.append(engine.submit(_ids_request(0, max_new_tokens=4)))
        except RuntimeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=submit)
    thread.start()
    assert entered.wait(10)
    engine.shutdown()
    go.set()
    thread.join(10)
    (got,) = outcome
    if isinstance(got, RuntimeError):
        assert "shut down" in str(got)
    else:
        assert got.wait(5).eos_reason == "cancelled"


def _submits_racing_shutdown(loaded, delay: float) -> tuple[list, list[str]]:
    """Four threads submit while this one shuts the engine down; returns the handles
    they got and the refusals."""
    engine = _tiny_engine(loaded).start()
    handles: list = []
    refused: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def submitter(worker: int) -> None:
        start.wait()
        for i in range(20):
            try:
                handle = engine.submit(_ids_request(worker * 100 + i, max_new_tokens=3))
            except RuntimeError as exc:
                with lock:
                    refused.append(str(exc))
                return
            with lock:
                handles.append(handle)

    threads = [threading.Thread(target=submitter, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    start.wait()
    time.sleep(delay)
    engine.shutdown()
    for t in threads:
        t.join(10)
    return handles, refused


def test_submits_racing_shutdown_all_finish(tiny):
    for round_ in range(30):
        handles, refused = _submits_racing_shutdown(tiny, 0.001 * (round_ % 5))
        for handle in handles:
            result = handle.wait(5)  # TimeoutError: a handle that never finishes
            assert result.eos_reason in ("cancelled", "length")
        assert all("shut down" in r for r in refused)


def test_a_tight_snapshot_poll_waits_for_the_next_publish(tiny):
    # A reader that polls again at once for the snapshot it already has would hold the
    # GIL the loop needs between torch calls (decode 27 -> 2.6 tok/s); it sleeps until
    # the loop publishes instead.
    eng = _tiny_engine(tiny).start()
    try:
        eng._snapshot.repeat_s = 60.0
        first = eng.snapshot()
        got = []

        def poll_twice() -> None:
            for _ in range(2):
                got.append(eng.snapshot())

        reader = threading.Thread(target=poll_twice)
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and len(got) == 1, "the repeat poll returned at once"
        eng.generate(_ids_request(0, max_new_tokens=2), timeout=60)
        reader.join(10)
        assert not reader.is_alive()
        assert got[1].version > first.version
        assert eng.snapshot().version >= got[1].version  # its last read was long ago: no wait
    finally:
        eng.shutdown()


def test_idle_snapshots_follow_the_disk_tier_writes(smollm2_int4, tmp_path, monkeypatch):
    """Pages of a finished job are written to disk by the tier's own thread after the
    engine went idle; the engine publishes again until a snapshot shows them all, so a
    reader never keeps the count from before the writes."""
    import engine.cache.disk_tier as disk_tier

    write_all = disk_tier._write_all

    def slow_write(fd: int, data: bytes) -> None:  # a slow disk: writes end after the step
        time.sleep(0.05)
        write_all(fd, data)

    monkeypatch.setattr(disk_tier, "_write_all", slow_write)
    eng = Engine(
        smollm2_int4, CacheSettings(page_size=16, token_budget=1024, disk_dir=str(tmp_path))
    )
    with eng:
        result = eng.generate(_chat("Name a colour.", max_new_tokens=4), timeout=120)
        eng.cache.disk.flush()
        written = eng.cache.disk.stats().pages
        assert written >= (result.prompt_tokens + result.new_tokens - 1) // 16
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = eng.snapshot()
            if (
                snap.cache.disk.pages == written
                and len(snap.cache.disk_records.hash_prefix) == written
            ):
                break
            time.sleep(0.05)
        assert snap.stats.pages_disk == written and not snap.jobs
        assert len(snap.cache.disk_records.hash_prefix) == written
        done = [e for e in eng.telemetry.events() if e["kind"] == "job_done"]
        assert done[-1]["disk_pages"] == 0 and "disk_bytes" in done[-1]


def test_the_engine_warms_its_kernels_up_on_a_scratch_cache(tiny, monkeypatch):
    """Starting an engine runs one token through the model (a process's first forward
    loads its kernels) on a one-page cache of the engine's K/V format, not on the
    engine's own cache, which starts empty."""
    import engine.model.runner as runner
    from engine.model.transformer import Transformer

    seen = []
    real = Transformer.forward

    def forward(self, tokens, batch, cache):
        seen.append((tokens.tolist(), cache))
        return real(self, tokens, batch, cache)

    monkeypatch.setattr(Transformer, "forward", forward)
    # kernels loaded, not compiled (a cold numba cache adds a prompt: the test below)
    monkeypatch.setattr(runner, "COMPILED_S", 1e9)
    engine = Engine(tiny, CacheSettings(page_size=64, token_budget=1024, v_bits=4))
    ((tokens, scratch),) = seen
    assert tokens == [0] and scratch is not engine.cache
    assert scratch.num_pages == 1 and scratch.page_size == 16  # small, whatever the engine's
    # the engine's K/V format: a quarter of the engine's 64-token page
    assert 4 * scratch.storage.bytes_per_page == engine.cache.storage.bytes_per_page
    assert engine.warm_up_error == ""
    stats = engine.cache.pages.stats()
    assert stats.pages_cached == 0 and engine.cache.pages.counters.prefix_query_tokens == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_a_warm_up_that_compiled_the_kernels_runs_a_prompt_too(tiny, monkeypatch, compiled):
    """A one-token warm-up longer than COMPILED_S compiled the kernels (a first start
    after an install or update), so the prompts' would compile in the first reply: the
    warm-up then runs a prompt as well, in a short step and one past the decode
    kernels' rows, on a scratch cache of its own; a warm-up that only loaded them runs
    the one token."""
    import engine.model.runner as runner
    from engine.model.transformer import Transformer

    seen = []
    real = Transformer.forward

    def forward(self, tokens, batch, cache):
        seen.append((tokens.numel(), cache.num_pages * cache.page_size))
        return real(self, tokens, batch, cache)

    monkeypatch.setattr(Transformer, "forward", forward)
    monkeypatch.setattr(runner, "COMPILED_S", -1.0 if compiled else 1e9)
    engine = Engine(tiny, CacheSettings(page_size=64, token_budget=1024))
    assert engine.warm_up_error == ""
    if not compiled:
        assert seen == [(1, runner.WARM_UP_PAGE)]
        return
    short, long = runner.PROMPT_WARM_UP_STEPS
    assert seen[0] == (1, runner.WARM_UP_PAGE) and len(seen) == 3
    (first, capacity), (second, same) = seen[1:]
    assert (first, second) == (short, long) and capacity == same >= short + long
    assert 1 < short <= DECODE_MAX_ROWS < long  # a batch's rows, then the prompt path
    assert engine.cache.pages.stats().pages_cached == 0  # the engine's own cache untouched


def test_a_warm_up_that_fails_leaves_the_engine_serving(tiny, monkeypatch):
    import engine.model.runner as runner

    def broken(*args):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(runner, "warm_up", broken)
    with _tiny_engine(tiny) as engine:
        assert engine.warm_up_error == "RuntimeError: no kernel for you"
        assert engine.submit(_ids_request(1, max_new_tokens=3)).wait(60).new_tokens == 3


def test_library_code_leaves_after_the_warm_up_and_before_the_cache(tiny, monkeypatch):
    """The engine's start drops the libraries' code from the resident set
    (engine.allocator) once the warm-up's forward has loaded the kernels, and allocates
    its cache after that, so that the peak RSS never holds both the cache's pages and the
    code only loading ran."""
    import engine.model.runner as runner
    from engine.cache.kv_cache import KVCache
    from engine.model.transformer import Transformer

    order = []
    real_forward, real_for_model = Transformer.forward, KVCache.for_model

    def forward(self, tokens, batch, cache):
        order.append("forward")
        return real_forward(self, tokens, batch, cache)

    def for_model(loaded, settings, *args, **kwargs):
        order.append(f"cache of {settings.token_budget} tokens")
        return real_for_model(loaded, settings, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", forward)
    monkeypatch.setattr(runner.allocator, "release_library_code", lambda: order.append("release"))
    monkeypatch.setattr(KVCache, "for_model", staticmethod(for_model))
    monkeypatch.setattr(runner, "COMPILED_S", 1e9)  # loaded, not compiled: one forward
    Engine(tiny, CacheSettings(page_size=64, token_budget=1024))
    assert order == ["cache of 16 tokens", "forward", "release", "cache of 1024 tokens"]
