"""What the main window says while a model loads, and which models it can switch to.

Nothing here knows Qt (`gui.models.model_bar` shows it):

- `LoadProgress` turns the loader's reports (`engine.model.loader`: a fraction and a step
  such as "layer 3/30") into one line with the step in words and the seconds left,
  extrapolated from the time the load has taken so far.
- `picker_entries` prices every local model for the cache the user has chosen, as the
  Discover tab prices a download (`engine.hub.fit`): weights as the chosen weight mode
  keeps them, K/V by the cache's formats, the runtime's overhead, against free memory.
"""

from __future__ import annotations

import json
import math
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cache.kv_cache import CacheSettings
from engine.hub.fit import CachePlan, FitEstimate
from engine.hub.library import LocalModel
from engine.hub.remote import ModelShape
from engine.units import format_bytes

ETA_AFTER_S = 1.0  # too early, the first layer's pace says little about the rest
ETA_AFTER_FRACTION = 0.05
_LAYER = re.compile(r"layer (\d+)/(\d+)(, .+)?")  # and what the layers' step does, if said
# steps whose length the pace so far says nothing about (no "about N s left")
UNPACED = {"allocating the KV cache"}
STEPS = {
    "tokenizer": "reading the tokenizer",
    # the engine's start: its warm-up, then its cache (the warm-up compiles the kernels
    # when numba's cache has none for this version: engine.model.runner.COMPILED_S)
    "allocating the KV cache": (
        "loading the kernels (compiled once after an install or update: up to a minute)"
        " and allocating the KV cache"
    ),
    "bf16 copies for batched decode": "making bf16 copies for batches",
    "ready": "starting the engine",
}


class LoadProgress:
    """One load's progress line: ``update`` with each report, read ``text``."""

    def __init__(
        self, name: str, verb: str = "Loading", clock: Callable[[], float] = time.monotonic
    ):
        self.name = name
        self.verb = verb
        self.clock = clock
        self.start = clock()
        self.fraction = 0.0
        self.step = "opening the file"
        self.paced = True

    def update(self, fraction: float, what: str) -> str:
        # Never backwards, whatever order the reports arrive in.
        self.fraction = min(max(float(fraction), self.fraction), 1.0)
        self.paced = what not in UNPACED
        layer = _LAYER.fullmatch(what.strip())
        if layer:
            self.step = f"layer {layer[1]} of {layer[2]}{layer[3] or ''}"
        else:
            self.step = STEPS.get(what, what)
        return self.text

    @property
    def seconds_left(self) -> float | None:
        """Extrapolated from the pace so far; None until there is a pace to go by."""
        elapsed = self.clock() - self.start
        if self.fraction < ETA_AFTER_FRACTION or elapsed < ETA_AFTER_S or self.fraction >= 1:
            return None
        if not self.paced:
            return None
        return elapsed * (1 - self.fraction) / self.fraction

    @property
    def text(self) -> str:
        line = f"{self.verb} {self.name}: {self.step} · {self.fraction:.0%}"
        left = self.seconds_left
        if left is not None:
            line += f" · about {max(1, math.ceil(left))} s left"
        return line


# -- the model picker ----------------------------------------------------------------------


@dataclass(frozen=True)
class PickerEntry:
    """A local model with what loading it would take."""

    model: LocalModel
    fit: FitEstimate | None
    plan: CachePlan | None
    note: str = ""  # why there is no fit, or what it leaves out

    @property
    def text(self) -> str:
        if self.fit is None:  # the reason is the tooltip's: it can be long
            return f"{self.model.name} — {'fit unknown' if self.model.loadable else 'cannot load'}"
        return f"{self.model.name} — {self.fit.label.value} · {format_bytes(self.fit.need_bytes)}"


def local_shape(model: LocalModel, weight_mode: str) -> ModelShape:
    """Layers, heads and resident weight bytes of a model on disk, from its headers:
    a GGUF file's tensor directory (kept as ``weight_mode`` keeps it), or a safetensors
    folder's config.json and headers (loaded as fp32)."""
    if model.format == "gguf":
        from engine.hub.gguf_info import summary_from_metadata
        from engine.model.gguf_file import GGUFFile
        from engine.model.weight_modes import resident_weight_bytes

        gf = GGUFFile(model.path)
        try:
            infos = list(gf.tensors.values())
            summary = summary_from_metadata(gf.metadata, infos, str(model.path))
            tensors = [(t.name, t.shape, t.nbytes) for t in infos]
        finally:
            gf.close()
        weights = resident_weight_bytes(tensors, weight_mode)
        return ModelShape(
            summary.num_layers, summary.num_kv_heads, summary.head_dim, weights, summary.vocab_size
        )
    from engine.hub.remote import shape_from_hf_config

    config = json.loads((model.path / "config.json").read_text(encoding="utf-8"))
    values = sum(_safetensors_values(f) for f in sorted(model.path.glob("*.safetensors")))
    return shape_from_hf_config(config, values * 4)


def _safetensors_values(path: Path) -> int:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def picker_entries(
    models: Sequence[LocalModel],
    cache: CacheSettings,
    weight_mode: str,
    free_bytes: int | None,
) -> list[PickerEntry]:
    """Every loadable model with its fit for ``cache``; models that cannot load are
    listed with the reason instead. ``free_bytes``: the memory a new model may use."""
    from engine.hub.remote import ModelCandidate, candidate_fit
    from gui.models.discover import cache_plan

    entries = []
    for model in models:
        if not model.loadable:
            entries.append(PickerEntry(model, None, None, f"cannot load: {model.problem}"))
            continue
        try:
            shape = local_shape(model, weight_mode)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            entries.append(PickerEntry(model, None, None, f"header not read ({exc})"))
            continue
        plan, note = cache_plan(cache, shape)
        candidate = ModelCandidate(
            "", "", model.format, model.name, (), model.quant, model.size_bytes
        )
        fit = candidate_fit(candidate, shape, plan, "cpu", free_bytes)
        entries.append(PickerEntry(model, fit, plan, note))
    return entries


# -- the process memory figure --------------------------------------------------------------


def process_memory_tip(
    rss: int,
    weight_bytes: int,
    weight_mode: str,
    batch_copy_bytes: int,
    kv_bytes: int,
    host_bytes: int,
    vocab_size: int | None = None,
) -> str:
    """Why the process takes the memory it does: the status bar figure's tooltip; the
    runtime's part priced for the model's ``vocab_size`` (engine/hub/fit.py)."""
    from engine.hub.fit import runtime_overhead_bytes

    runtime = runtime_overhead_bytes(vocab_size)

    def size(n: int) -> str:
        return format_bytes(n, binary=True)

    kept = {
        "native": "the file mapped and read in place: its pages count once read",
        "bf16": "bf16 copies made at load",
        "dequant": "fp32 copies made at load",
    }.get(weight_mode, f"kept as {weight_mode}")
    lines = [
        f"Process memory {size(rss)}: the memory of this process in RAM now (resident set).",
        f"  model weights {size(weight_bytes)} ({kept})",
    ]
    if batch_copy_bytes:
        lines.append(f"+ bf16 copies for batched replies {size(batch_copy_bytes)}")
    lines.append(
        f"+ KV cache up to {size(kv_bytes)} (the whole page pool; pages never written may "
        "not count yet)"
    )
    if host_bytes:
        lines.append(f"+ host tier {size(host_bytes)}")
    lines.append(
        f"+ runtime about {size(runtime)} (Python, torch, numba, the tokenizer, the "
        "compiled kernels and a step's activations: Folio's measured floor)"
    )
    accounted = weight_bytes + batch_copy_bytes + kv_bytes + host_bytes + runtime
    rest = rss - accounted
    if rest >= 0:
        lines.append(
            f"= {size(accounted)}; the other {size(rest)}: the window, allocator caches and "
            "buffers the libraries keep."
        )
    else:
        lines.append(
            f"= up to {size(accounted)}; {size(-rest)} of that is not in RAM (yet): "
            "unwritten cache pages, unread weights."
        )
    return "\n".join(lines)
