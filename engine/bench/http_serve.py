"""`folio bench serve --http`: the serving workload over HTTP, against `folio serve` and,
in the same run, llama.cpp's `llama-server` on the same GGUF and the same prompts.

The workload is `folio bench serve`'s: requests arriving over time (Poisson, seeded),
groups of them sharing a long system prompt, each with its own question. Prompts are
text (slices of the shipped reference text), so each server tokenizes them itself; each
request is one streaming client on a thread of its own (`POST /v1/completions`, greedy,
`ignore_eos`, usage in the last chunk). Measured at the client: time to first token
(from the request's scheduled arrival), inter-token latency (between streamed tokens),
throughput (output tokens / the whole run) and the prompt tokens each server says it
found in its cache (`usage.prompt_tokens_details.cached_tokens`, or llama-server's
`timings.cache_n`).

Targets run one after the other, each on the machine alone: `folio serve` started here
on --model (or the server at --url), then `llama-server` (--llama-server PATH) on the
same file. The ratios printed last compare them on this run's numbers only. `--threads N`
gives both servers N threads (llama.cpp's threads spin while they wait for each other,
so on a machine with busy cores it may need fewer than torch's).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

from engine.reference_text import reference_text

CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary, roughly: sizes the prompts


@dataclass
class Request:
    at: float  # seconds after the start
    group: int
    prompt: str


@dataclass
class Outcome:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between streamed tokens
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


def workload(args: argparse.Namespace) -> list[Request]:
    """The requests: the same for every target (seeded)."""
    text = reference_text()
    rng = random.Random(1234)
    size = args.system_tokens * CHARS_PER_TOKEN
    systems = [text[5000 + g * size : 5000 + (g + 1) * size] for g in range(args.groups)]
    t, out = 0.0, []
    for i in range(args.requests):
        g = rng.randrange(args.groups)
        start = 200_000 + i * 997
        question = text[start : start + rng.randint(16, 64) * CHARS_PER_TOKEN]
        out.append(Request(t, g, systems[g] + "\n\nQuestion: " + question))
        t += rng.expovariate(args.rate)
    return out


def run_target(name: str, url: str, model: str, requests: list[Request], args) -> dict:
    """Every request against the server at ``url`` as its own streaming client."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    outcomes = [Outcome() for _ in requests]
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30.0, read=600.0)) as c:
        t0 = time.perf_counter()
        threads = []
        for req, out in zip(requests, outcomes, strict=True):
            wait = t0 + req.at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            th = threading.Thread(target=_client, args=(c, model, req, t0, out, args))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        makespan = time.perf_counter() - t0
    failed = [o.error for o in outcomes if o.error]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} of {len(requests)} requests failed: {failed[0]}")
    ttft = [o.ttft for o in outcomes]
    gaps = [g for o in outcomes for g in o.gaps]
    tokens = sum(o.output_tokens for o in outcomes)
    return {
        "target": name,
        "requests": len(requests),
        "prompt_tokens": sum(o.prompt_tokens for o in outcomes),
        "cached_tokens": sum(o.cached_tokens for o in outcomes),
        "output_tokens": tokens,
        "makespan_s": round(makespan, 2),
        "output_tokens_per_s": round(tokens / makespan, 2),
        "ttft_median_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": round(_quantile(ttft, 0.9), 4),
        "itl_median_s": round(statistics.median(gaps), 4) if gaps else None,
        "itl_p90_s": round(_quantile(gaps, 0.9), 4) if gaps else None,
    }


def _client(c: httpx.Client, model: str, req: Request, t0: float, out: Outcome, args) -> None:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": args.new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    last = 0.0
    try:
        with c.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code >= 400:
                response.read()
                out.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return
            for line in response.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if any(ch.get("text") for ch in chunk.get("choices") or ()):
                    if not last:
                        out.ttft = now - (t0 + req.at)
                    else:
                        out.gaps.append(now - last)
                    last = now
                    out.output_tokens += 1
                _usage(chunk, out)
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"


def _usage(chunk: dict, out: Outcome) -> None:
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.output_tokens = int(usage.get("completion_tokens") or out.output_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])
    timings = chunk.get("timings")  # llama-server's own figures
    if isinstance(timings, dict) and "cache_n" in timings:
        out.cached_tokens = int(timings["cache_n"])


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _process(
    cmd: list[str],
    ready: re.Pattern[str],
    what: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Iterator[re.Match]:
    """Start ``cmd``; yield the match of its first output line that says it is ready."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # all of its output, so a full pipe never stalls it
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    said: list[str] = []
    found = None
    deadline = time.monotonic() + timeout
    try:
        while found is None:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if not line:  # it exited
                break
            said.append(line)
            found = ready.search(line)
        if found is None:
            raise RuntimeError(f"{what} did not start:\n" + "".join(said[-20:]))
        yield found
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _slots(args: argparse.Namespace) -> int:
    return min(16, args.requests)


@contextmanager
def folio_server(model: Path, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """`folio serve` on ``model``: (url, model id)."""
    cmd = [sys.executable, "-m", "folio", "serve", "--model", str(model), "--port", "0",
           "--cache-tokens", str(args.cache_tokens), "--max-batch-size", str(_slots(args)),
           "--no-disk-cache", "--log-level", "warning"]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    pattern = re.compile(r"serving (http://\S+)/v1 \(model id '([^']*)'")
    env = None
    if args.threads:  # torch's and numba's thread pools
        n = str(args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": n, "NUMBA_NUM_THREADS": n}
    with _process(cmd, pattern, "folio serve", env) as found:
        yield found.group(1), found.group(2)


@contextmanager
def llama_server(binary: Path, model: Path, args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """llama.cpp's server on the same file: as many slots as Folio's batch, each with room
    for one request, prompt caching on (its default)."""
    port = _free_port()
    per_slot = args.system_tokens + 128 + args.new_tokens + 64
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(_slots(args)), "-c", str(_slots(args) * per_slot), "--metrics"]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.threads:
        cmd += ["-t", str(args.threads), "-tb", str(args.threads)]
    with _process(cmd, re.compile(r"listening on http"), "llama-server"):
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        yield url, model.name


def _wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never became healthy")


def _model_of(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    return str(data["data"][0]["id"])


def run_http_serve_bench(args: argparse.Namespace) -> list[dict]:
    """Each target's row, then the ratios (printed as JSON lines with --json)."""
    if args.llama_server:
        if args.model is None or Path(args.model).suffix != ".gguf":
            raise ValueError("--llama-server needs --model FILE.gguf (the file both servers load)")
        if not Path(args.llama_server).is_file():
            raise ValueError(
                f"no llama-server at {args.llama_server}: build llama.cpp's llama-server "
                "target (cmake --build build --target llama-server) and give its path"
            )
    requests = workload(args)
    rows = []

    def report(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row) if args.json else f"serve --http {row}", flush=True)

    model = args.model
    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
        report(run_target("url", url, _model_of(url, args.api_key), requests, args))
    else:
        if model is None:
            from engine.model.fetch import ensure_default_model

            model = ensure_default_model()
        with folio_server(model, args) as (url, model_id):
            run_target("warm-up", url, model_id, requests[:2], args)
            report(run_target("folio", url, model_id, requests, args))
    if args.llama_server:
        with llama_server(Path(args.llama_server), Path(model), args) as (url, model_id):
            run_target("warm-up", url, model_id, requests[:2], args)
            report(run_target("llama-server", url, model_id, requests, args))
    if len(rows) == 2:
        a, b = rows
        ratios = {
            "throughput_folio_vs_llama_server": round(
                a["output_tokens_per_s"] / b["output_tokens_per_s"], 2
            ),
            "ttft_median_llama_server_vs_folio": round(b["ttft_median_s"] / a["ttft_median_s"], 2),
            "itl_median_llama_server_vs_folio": round(b["itl_median_s"] / a["itl_median_s"], 2),
            "cached_tokens_folio_llama_server": [a["cached_tokens"], b["cached_tokens"]],
        }
        print(json.dumps(ratios) if args.json else f"ratios {ratios}", flush=True)
    return rows
