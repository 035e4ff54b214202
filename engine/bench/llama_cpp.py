"""llama.cpp's own benchmarks, run on a GGUF file: the figures Folio's are set beside.

`llama-bench -o json` gives prompt (pp) and decode (tg) speed, each the mean and standard
deviation over its repetitions; `llama-batched-bench --output-format jsonl` gives one row
per batch size B: S_PP, S_TG and S (tokens per second) as its README defines them.
Parsing is kept apart from running (``parse_*``), so the tests read recorded outputs.

Peak memory is the tool's maximum resident set size as GNU time (``/usr/bin/time -f %M``)
reports it, in bytes; None where GNU time is missing.

``repack=None`` (the default) runs with llama.cpp's default, weight repacking on, and
when the tool dies of SIGILL or SIGSEGV runs it again with repacking off (see
:data:`SIGILL_HINT`); each report says which it used.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

BENCH = "llama-bench"
BATCHED_BENCH = "llama-batched-bench"
SERVER = "llama-server"
TOOLS = (BENCH, BATCHED_BENCH)


class LlamaCppError(RuntimeError):
    """A llama.cpp tool is missing, failed, or printed something that is not its report."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def find_tools(folder: Path | str, names: Sequence[str] = TOOLS) -> dict[str, Path]:
    """The executables ``names`` in ``folder`` (a llama.cpp ``build/bin``), by name."""
    folder = Path(folder)
    found, missing = {}, []
    for name in names:
        path = folder / (name + (".exe" if os.name == "nt" else ""))
        if path.is_file() and os.access(path, os.X_OK):
            found[name] = path
        else:
            missing.append(name)
    if missing:
        where = "does not exist" if not folder.is_dir() else "lacks " + ", ".join(missing)
        raise LlamaCppError(
            f"{folder} {where}: build llama.cpp there "
            f"(cmake --build build --target {' '.join(missing)})"
        )
    return found


# -- llama-bench ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    """Tokens per second over a benchmark's repetitions."""

    avg: float
    stddev: float
    samples: tuple[float, ...] = ()


@dataclass(frozen=True)
class LlamaBenchReport:
    model: str
    model_type: str  # llama.cpp's description, e.g. "llama 1B Q4_K - Medium"
    model_bytes: int
    parameters: int
    threads: int
    n_prompt: int
    n_gen: int
    prompt: Rate | None  # the pp test; None when n_prompt was 0
    decode: Rate | None  # the tg test; None when n_gen was 0
    build: str
    cpu: str
    repack: bool = True  # weight repacking (ggml's extra CPU buffer types) was on
    peak_rss_bytes: int | None = None  # of the llama-bench process, when run here


def parse_llama_bench(text: str) -> LlamaBenchReport:
    """A report from ``llama-bench -o json`` output: one pp and/or one tg test."""
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as exc:
        raise LlamaCppError(f"llama-bench printed JSON that does not parse: {exc}") from exc
    if not isinstance(tests, list) or not tests:
        raise LlamaCppError("llama-bench printed no tests (is -o json set?)")
    prompt = decode = None
    for test in tests:
        rate = Rate(
            float(test["avg_ts"]),
            float(test["stddev_ts"]),
            tuple(float(s) for s in test.get("samples_ts", ())),
        )
        if test["n_prompt"] > 0 and test["n_gen"] == 0:
            prompt = rate
        elif test["n_gen"] > 0 and test["n_prompt"] == 0:
            decode = rate
        else:  # -pg tests mix both; this runner does not ask for them
            raise LlamaCppError(
                f"unexpected llama-bench test pp={test['n_prompt']} tg={test['n_gen']}"
            )
    first = tests[0]
    return LlamaBenchReport(
        model=str(first["model_filename"]),
        model_type=str(first["model_type"]),
        model_bytes=int(first["model_size"]),
        parameters=int(first["model_n_params"]),
        threads=int(first["n_threads"]),
        n_prompt=max(int(t["n_prompt"]) for t in tests),
        n_gen=max(int(t["n_gen"]) for t in tests),
        prompt=prompt,
        decode=decode,
        build=f"{first['build_commit']} ({first['build_number']})",
        cpu=str(first.get("cpu_info", "")),
        repack=bool(first.get("repack", True)),
    )


def run_llama_bench(
    folder: Path | str,
    model: Path | str,
    threads: int,
    n_prompt: int = 512,
    n_gen: int = 64,
    repetitions: int = 5,
    repack: bool | None = None,
    extra_args: Sequence[str] = (),
    timeout: float | None = 3600,
    depth: int = 0,
) -> LlamaBenchReport:
    """``llama-bench -m MODEL -t N -p n_prompt -n n_gen -r repetitions -o json`` (plus
    ``--repack 0`` when repacking is off, and ``-d depth``: each test runs after that
    many tokens already in the context, where llama-bench otherwise starts empty)."""
    tool = find_tools(folder, (BENCH,))[BENCH]
    cmd = [str(tool), "-m", str(model), "-t", str(threads), "-p", str(n_prompt)]
    cmd += ["-n", str(n_gen), "-r", str(repetitions), "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]

    def command(repack: bool) -> list[str]:
        return [*cmd, *([] if repack else ["--repack", "0"]), *extra_args]

    out, _, rss, _ = _run_repacking(command, repack, timeout)
    return replace(parse_llama_bench(out), peak_rss_bytes=rss)


# -- llama-batched-bench ------------------------------------------------------------------


@dataclass(frozen=True)
class BatchRow:
    """One line of llama-batched-bench's table (times in s, speeds in tokens/s)."""

    pp: int
    tg: int
    batch: int  # B: sequences decoded together
    n_kv: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float
    t: float
    s: float


@dataclass(frozen=True)
class BatchedBenchReport:
    rows: tuple[BatchRow, ...]
    threads: int
    shared_prompt: bool
    repack: bool = True
    peak_rss_bytes: int | None = None

    def by_batch(self) -> dict[int, BatchRow]:
        return {row.batch: row for row in self.rows}


def parse_batched_bench(text: str) -> BatchedBenchReport:
    """A report from ``llama-batched-bench --output-format jsonl`` output (log lines around
    the JSON ones are skipped)."""
    rows, threads, shared = [], 0, False
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlamaCppError(f"llama-batched-bench printed a damaged line {line!r}") from exc
        threads, shared = int(r["n_threads"]), bool(r["is_pp_shared"])
        rows.append(
            BatchRow(
                int(r["pp"]),
                int(r["tg"]),
                int(r["pl"]),
                int(r["n_kv"]),
                float(r["t_pp"]),
                float(r["speed_pp"]),
                float(r["t_tg"]),
                float(r["speed_tg"]),
                float(r["t"]),
                float(r["speed"]),
            )
        )
    if not rows:
        raise LlamaCppError(
            "llama-batched-bench printed no results (is --output-format jsonl set?)"
        )
    return BatchedBenchReport(tuple(rows), threads, shared)


def run_batched_bench(
    folder: Path | str,
    model: Path | str,
    threads: int,
    npp: int = 128,
    ntg: int = 128,
    npl: Sequence[int] = (1, 4, 16),
    shared_prompt: bool = False,
    repack: bool | None = None,
    extra_args: Sequence[str] = (),
    timeout: float | None = 3600,
) -> BatchedBenchReport:
    """``llama-batched-bench`` with a context just large enough for the widest batch (the
    tool silently skips a batch whose KV cache would not fit); ``--no-repack`` when
    repacking is off.

    llama.cpp's logger writes from a thread that is not flushed at exit (common/log.cpp
    leaks it on purpose), so the last row or two can go missing; those batch sizes are run
    again, followed by a throwaway run of the smallest one to take the loss."""
    tool = find_tools(folder, (BATCHED_BENCH,))[BATCHED_BENCH]
    widest = max(npl)
    n_ctx = npp + widest * ntg if shared_prompt else widest * (npp + ntg)
    cmd = [str(tool), "-m", str(model), "-t", str(threads), "-c", str(n_ctx)]
    cmd += ["-npp", str(npp), "-ntg", str(ntg), "--output-format", "jsonl"]
    cmd += [*(["-pps"] if shared_prompt else []), *extra_args]

    def command(batches: Sequence[int]) -> Callable[[bool], list[str]]:
        listed = ["-npl", ",".join(str(b) for b in batches)]
        return lambda repack: [*cmd, *listed, *([] if repack else ["--no-repack"])]

    out, err, rss, repack = _run_repacking(command(npl), repack, timeout)
    report = parse_batched_bench(out + "\n" + err)
    rows = {}
    for row in report.rows:
        rows.setdefault(row.batch, row)
    missing = [b for b in npl if b not in rows]
    if missing:
        out, err, again, _ = _run_repacking(command([*missing, min(npl)]), repack, timeout)
        for row in parse_batched_bench(out + "\n" + err).rows:
            rows.setdefault(row.batch, row)
        rss = None if rss is None or again is None else max(rss, again)
    missing = [b for b in npl if b not in rows]
    if missing:
        raise LlamaCppError(f"llama-batched-bench skipped batch sizes {missing} (context {n_ctx})")
    ordered = tuple(rows[b] for b in dict.fromkeys(npl))
    return replace(report, rows=ordered, repack=repack, peak_rss_bytes=rss)


# -- running a child ------------------------------------------------------------------------

# GNU time reports the child's own peak RSS. getrusage's ru_maxrss of a direct child is no
# good here: on Linux a child starts with the high-water mark of the process it was forked
# from (Python with torch loaded: ~500 MB) and keeps it across exec.
GNU_TIME = Path("/usr/bin/time")
# killed by SIGILL or SIGSEGV: directly, or as GNU time reports it. A VM that does not
# grant AMX's tile state faults on ggml's first tile instruction: SIGILL on one host, a
# general protection fault (SIGSEGV) on another (a Sapphire Rapids guest, the kernel log
# naming libggml-cpu)
SIGILL_EXITS = (-4, 128 + 4, -11, 128 + 11)
SIGILL_HINT = (
    "the build uses an instruction this machine refuses (seen: AMX tile instructions of "
    "ggml's AMX buffer in a VM, from a -march=native build: SIGILL, or SIGSEGV from a "
    "general protection fault); run with repack=False "
    "(--repack 0 / --no-repack), which turns off ggml's extra CPU buffer types, AMX "
    "included (the runners do so by themselves unless told repack=True), or rebuild "
    "without GGML_NATIVE"
)


def _run_repacking(
    command: Callable[[bool], list[str]], repack: bool | None, timeout: float | None
) -> tuple[str, str, int | None, bool]:
    """``run_measured(command(repack))``; for ``repack=None`` with repacking on, and off
    again after a SIGILL or SIGSEGV (:data:`SIGILL_EXITS`). The last value says whether
    repacking was on."""
    if repack is not None:
        return *run_measured(command(repack), timeout), repack
    try:
        return *run_measured(command(True), timeout), True
    except LlamaCppError as exc:
        if exc.returncode not in SIGILL_EXITS:
            raise
        return *run_measured(command(False), timeout), False


def run_measured(cmd: Sequence[str], timeout: float | None = None) -> tuple[str, str, int | None]:
    """Run ``cmd``; its stdout, stderr and peak RSS in bytes (None without GNU time at
    /usr/bin/time). Raises LlamaCppError when it fails or outlives ``timeout`` seconds
    (then it is killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        timed = GNU_TIME.is_file()
        full = [str(GNU_TIME), "-f", "%M", "-o", str(rss_file), *cmd] if timed else list(cmd)
        with open(Path(tmp) / "out", "w+b") as out_f, open(Path(tmp) / "err", "w+b") as err_f:
            proc = subprocess.Popen(
                full, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, start_new_session=True
            )
            timed_out = False
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # time and the tool: their own group
                proc.wait()
                timed_out = True
            out_f.seek(0)
            err_f.seek(0)
            out = out_f.read().decode("utf-8", "replace")
            err = err_f.read().decode("utf-8", "replace")
        rss = _time_rss(rss_file) if timed else None
    if timed_out or proc.returncode != 0:
        why = f"timed out after {timeout} s" if timed_out else f"exited with {proc.returncode}"
        tail = "\n".join(err.strip().splitlines()[-15:])
        if not timed_out and proc.returncode in SIGILL_EXITS:
            tail += "\n" + SIGILL_HINT
        raise LlamaCppError(
            f"{Path(cmd[0]).name} {why}: {' '.join(map(str, cmd))}\n{tail}",
            None if timed_out else proc.returncode,
        )
    return out, err, rss


def _time_rss(path: Path) -> int | None:
    """GNU time's ``%M`` (KiB) in bytes; it writes a status line first when the command
    failed."""
    try:
        lines = path.read_text().split()
        return int(lines[-1]) * 1024
    except (OSError, ValueError, IndexError):
        return None


def format_rate(rate: Rate | None) -> str:
    if rate is None:
        return "-"
    return (
        f"{rate.avg:.2f} ± {rate.stddev:.2f}" if math.isfinite(rate.stddev) else f"{rate.avg:.2f}"
    )
