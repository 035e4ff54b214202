"""The one check Folio's CUDA path gets on a GPU machine (issue 18), in one call of < 8 min.

The GPU machine starts bare: Python 3.12 with torch, triton, numpy, transformers and numba
(and transformers' own dependencies: tokenizers, safetensors, huggingface_hub, yaml, ...),
no package registry, at most 64 MiB carried along. So the check makes its own models (the
tiny random models of the tests, the real-shape random GGUFs of ``folio bench``) and brings
the few pure-Python packages Folio needs beyond those in ``.device_deps/``, which
``--pack`` fills on a development machine:

* ``gguf`` (GGUF constants, the test models' writer, the reference dequantizer),
  ``platformdirs`` (Folio's folders), ``pytest`` with ``pluggy``, ``iniconfig`` and
  ``pygments`` (the ``cuda`` tests);
* ``smollm2-vocab.gguf``: SmolLM2's tokenizer alone (no tensors, about 2 MB), the
  vocabulary the real-shape GGUFs are written with (the model itself is 98 MB).

Steps, each with its own time limit, results gathered as they come: the environment; the
imports Folio's CUDA path needs; whether torch sees a GPU (if not: the JSON says why, exit
3); ``pytest -m cuda``; ``folio bench forward --shape`` for Llama-3.2-1B (2,048-token
prefill, decode at B = 1, 16, 64) and Qwen2-7B in Q4_K_M; ``folio bench batched`` on the 1B
shape. Writes ``device_check.json`` to ``--out`` (``$OUT`` on the GPU machine).

Run it there as ``bash tools/device_check.sh`` (carry ``.device_deps``); here,
``python tools/device_check.py --pack`` first.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's Folio, whatever else is installed
DEPS = ROOT / ".device_deps"
VOCAB = DEPS / "smollm2-vocab.gguf"
# pure-Python packages copied from this environment by --pack (import name: files)
PACKED = ("gguf", "platformdirs", "pytest", "_pytest", "pluggy", "iniconfig", "pygments", "py.py")
# what the CUDA path imports, beyond the standard library
NEEDED = ("torch", "triton", "numpy", "numba", "transformers", "tokenizers", "gguf",
          "platformdirs", "jinja2", "pytest")  # fmt: skip
BUDGET_S = 450  # the machine allows 8 minutes; leave room to start and copy back
H200_BANDWIDTH = 4.3e12  # bytes/s the issue measures decode against


def machine_distributions() -> set[str]:
    """The distributions the GPU machine has: its five packages and, recursively, what
    they require (as pip would have installed them), as named in this environment."""
    import re
    from importlib import metadata

    wanted, seen = ["torch", "triton", "numpy", "numba", "transformers"], set()
    while wanted:
        name = wanted.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen:
            continue
        seen.add(key)
        for req in dist.requires or []:
            if "extra ==" not in req:
                wanted.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
    return seen


def bare_site(folder: Path) -> Path:
    """A folder of links to just the distributions the GPU machine has (their modules
    and dist-info), from this environment: with ``python -S`` and it on PYTHONPATH, an
    import fails here where it would there."""
    from importlib import metadata

    folder.mkdir(parents=True, exist_ok=True)
    keep = machine_distributions()
    for dist in metadata.distributions():
        if dist.metadata["Name"].lower().replace("-", "_") not in keep:
            continue
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            entry = base / top
            link = folder / top
            if top != "__pycache__" and not top.endswith(".pth") and entry.exists():
                if not link.exists():
                    link.symlink_to(entry)
    return folder


def pack() -> None:
    """Fill .device_deps with the packages above and SmolLM2's vocabulary."""
    DEPS.mkdir(exist_ok=True)
    for name in PACKED:
        module = importlib.import_module(name.removesuffix(".py"))
        source = Path(module.__file__)
        source = source.parent if source.name == "__init__.py" else source
        target = DEPS / source.name
        if target.is_dir():
            shutil.rmtree(target)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    from engine.bench.shapes import write_vocabulary_gguf

    write_vocabulary_gguf(VOCAB)
    size = sum(p.stat().st_size for p in DEPS.rglob("*") if p.is_file())
    print(f"{DEPS}: {size / 2**20:.1f} MiB (carry it: the limit is 64 MiB with the tree)")


class Check:
    """The results so far, written after every step (a step that hangs past the machine's
    limit still leaves the earlier ones)."""

    def __init__(self, out: Path):
        self.out = out
        self.start = time.monotonic()
        self.results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def left(self) -> float:
        return BUDGET_S - (time.monotonic() - self.start)

    def save(self, **fields) -> None:
        self.results.update(fields)
        self.results["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "device_check.json").write_text(json.dumps(self.results, indent=1))

    def run(self, name: str, argv: list[str], limit: float) -> subprocess.CompletedProcess | None:
        """A command with at most ``limit`` seconds (less if the budget is shorter); its
        output's tail goes into the results under ``name``."""
        limit = min(limit, self.left() - 10)
        if limit < 20:
            self.save(**{name: {"skipped": "out of time"}})
            return None
        t = time.monotonic()
        try:
            done = subprocess.run(
                argv, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=os.environ
            )
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-3000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            self.save(**{name: {"timed_out_s": round(limit), "output_tail": tail}})
            return None
        record = {"rc": done.returncode, "seconds": round(time.monotonic() - t, 1)}
        if done.returncode != 0:
            record["stderr_tail"] = done.stderr[-3000:]
        self.save(**{name: record})
        return done


def python() -> list[str]:
    """This interpreter, without site-packages when simulating the bare machine."""
    return [sys.executable, "-S"] if os.environ.get("FOLIO_BARE_SITE") else [sys.executable]


def json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def environment(check: Check) -> bool:
    """Versions, and which imports fail; False when the check cannot go on."""
    missing = {}
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
            missing[name] = f"{type(exc).__name__}: {exc}"
    import torch

    check.save(
        python=sys.version.split()[0],
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        triton=getattr(sys.modules.get("triton"), "__version__", None),
        missing_imports=missing,
    )
    return not missing


@dataclass(frozen=True)
class Plan:
    """What one run measures: on the GPU, the issue's figures; ``--rehearse``, the same
    steps on the CPU at a toy size (the script's own check, without a GPU)."""

    device: str
    forward: tuple[tuple[str, int, tuple[int, ...]], ...]  # shape, prompt tokens, batches
    batched: tuple[str, int, int, tuple[int, ...]]  # shape, PP, TG, batches
    tg: int


GPU = Plan("cuda", (("llama-3.2-1b", 2048, (1, 16, 64)), ("qwen2-7b", 512, (64,))),
           ("llama-3.2-1b", 128, 32, (1, 16, 64)), 32)  # fmt: skip
REHEARSAL = Plan("cpu", (("tiny-llama", 64, (2,)),), ("tiny-llama", 32, 4, (1, 2)), 4)


def make_shapes(check: Check, plan: Plan) -> dict[str, str]:
    """The real-shape GGUFs, written once (into the cache folder folio bench reads)."""
    from engine.bench.shapes import make_shape_gguf

    made = {}
    for name in dict.fromkeys([f[0] for f in plan.forward] + [plan.batched[0]]):
        t = time.monotonic()
        path = make_shape_gguf(name, "q4_k_m", vocab_source=VOCAB if VOCAB.exists() else None)
        made[name] = str(path)
        check.save(**{f"make_{name}_s": round(time.monotonic() - t, 1)})
    return made


def bench_forward(check: Check, plan: Plan, shape: str, prompt: int, batches: tuple[int, ...]):
    name = f"forward_{shape}"
    done = check.run(
        name,
        [*python(), "-m", "folio", "bench", "forward", "--shape", shape, "--quant", "q4_k_m",
         "--device", plan.device, "--prompt-tokens", str(prompt), "--tg", str(plan.tg),
         "--batch", *map(str, batches)],
        150,
    )  # fmt: skip
    if done is None:
        return
    rows = json_lines(done.stdout)
    figures = next((r for r in rows if r.get("engine") == "folio"), None)
    if figures is not None and figures.get("decode_gb_s") and plan.device == "cuda":
        figures["decode_share_of_4_3_tb_s"] = round(
            figures["decode_gb_s"] * 1e9 / H200_BANDWIDTH, 3
        )
    check.save(**{name: {**check.results[name], "records": rows}})


def measure(check: Check, plan: Plan) -> None:
    made = make_shapes(check, plan)
    tests = check.run(
        "cuda_tests",
        [*python(), "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
         "tests/engine/test_cuda.py"],
        150,
    )  # fmt: skip
    if tests is not None:
        lines = tests.stdout.splitlines()
        check.save(cuda_tests={**check.results["cuda_tests"], "summary": lines[-1:],
                               "output_tail": tests.stdout[-4000:]})  # fmt: skip
    first, *rest = plan.forward  # the main figures first, while time is plentiful
    bench_forward(check, plan, *first)
    shape, pp, tg, batches = plan.batched
    for graphs in ("on", "off"):  # side by side: what replaying CUDA graphs buys
        name = f"batched_{shape}_graphs_{graphs}"
        batched = check.run(
            name,
            [*python(), "-m", "folio", "bench", "batched", "--model", made[shape], "--device",
             plan.device, "--json", "--skip-transformers", "--pp", str(pp), "--tg", str(tg),
             "--batch", *map(str, batches), "--cuda-graphs", graphs],
            90,
        )  # fmt: skip
        if batched is not None:
            check.save(**{name: {**check.results[name], "rows": json_lines(batched.stdout)}})
    for shape, prompt, batches in rest:
        bench_forward(check, plan, shape, prompt, batches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_check_out")))
    parser.add_argument("--pack", action="store_true", help="fill .device_deps here, then exit")
    parser.add_argument(
        "--simulate-bare",
        action="store_true",
        help="run with only the packages the GPU machine has (python -S and a folder of links)",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="the same steps on the CPU at a toy size, no GPU needed (checks the script)",
    )
    args = parser.parse_args(argv)
    if args.pack:
        pack()
        return 0
    if args.simulate_bare and os.environ.get("FOLIO_BARE_SITE") is None:
        site_dir = bare_site(Path(os.environ.get("TMPDIR", "/tmp")) / "folio-bare-site")
        env = {**os.environ, "FOLIO_BARE_SITE": str(site_dir)}
        env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{site_dir}".lstrip(":")
        argv = [sys.executable, "-S", __file__, *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(argv, env=env).returncode
    check = Check(args.out)
    if not environment(check):
        print(f"device check: imports missing: {check.results['missing_imports']}")
        check.save(status="missing imports")
        return 2
    if args.rehearse:
        measure(check, REHEARSAL)
        check.save(status="rehearsed on the CPU")
        print(json.dumps(check.results)[:3000])
        return 0
    import torch

    from engine.device import cuda_absence_reason

    if not torch.cuda.is_available():
        reason = cuda_absence_reason()
        check.save(status="no GPU", reason=reason)
        print(f"device check: no CUDA GPU ({reason}); nothing to measure")
        return 3
    check.save(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count())
    measure(check, GPU)
    check.save(status="done")
    print(json.dumps(check.results)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
