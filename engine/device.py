"""Where the engine computes: ``auto``, ``cpu`` or ``cuda[:N]`` (issue 18).

One small module that the command line (``--device``), the app's Engine settings and the
loader share: :func:`parse_device` checks what a user typed, :func:`resolve_device` turns
it into a ``torch.device`` or says in one line why it cannot (no CUDA build of torch, no
driver, no such GPU), and :func:`resolve_or_cpu` is the app's version, which runs on the
CPU instead and returns the note to show. torch is imported when a choice is resolved,
not when this module is.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # and cuda:N
DEFAULT_DEVICE = "auto"

_SPEC = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


class DeviceError(ValueError):
    """A device that is not a choice, or one this machine does not have."""


@dataclass(frozen=True)
class DeviceChoice:
    """A checked device choice; ``index`` only with ``cuda``."""

    kind: str  # "auto", "cpu" or "cuda"
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: str) -> DeviceChoice:
    """``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (any case, spaces ignored)."""
    spec = str(text).strip().lower()
    m = _SPEC.fullmatch(spec)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise DeviceError(
            f"device {text!r} is not one of auto, cpu, cuda or cuda:N (N a GPU number)"
        )
    return DeviceChoice(m.group(1), int(m.group(2)) if m.group(2) is not None else None)


def cuda_absence_reason() -> str | None:
    """Why torch sees no CUDA GPU here, in words; None when it sees one."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build, install its CUDA build"
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU, "
        "no NVIDIA driver or none visible (CUDA_VISIBLE_DEVICES)"
    )


def resolve_device(text: str | DeviceChoice, what: str = "--device") -> torch.device:
    """The ``torch.device`` a choice means on this machine; ``DeviceError`` (one line,
    led by ``what`` and the choice) when it names a GPU this machine lacks."""
    import torch

    choice = text if isinstance(text, DeviceChoice) else parse_device(text)
    if choice.kind == "cpu":
        return torch.device("cpu")
    if choice.kind == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    problem = _missing_gpu(choice)
    if problem is not None:
        raise DeviceError(f"{what} {choice}: {problem}; use cpu or auto")
    return torch.device("cuda", choice.index or 0)


def resolve_or_cpu(text: str | DeviceChoice) -> tuple[torch.device, str | None]:
    """The app's resolution: a GPU that is not there means the CPU, with the note to show
    (None when the choice was honoured). A choice that does not parse counts as auto."""
    import torch

    try:
        choice = text if isinstance(text, DeviceChoice) else parse_device(text)
    except DeviceError as exc:
        return resolve_device(DEFAULT_DEVICE), f"{exc}: using {DEFAULT_DEVICE}"
    if choice.kind == "cuda":
        problem = _missing_gpu(choice)
        if problem is not None:
            return torch.device("cpu"), f"device {choice}: {problem}; running on the CPU"
    return resolve_device(choice), None


def _missing_gpu(choice: DeviceChoice) -> str | None:
    """What keeps ``cuda[:N]`` from running here, or None."""
    import torch

    reason = cuda_absence_reason()
    if reason is not None:
        return f"no CUDA GPU is available: {reason}"
    count = torch.cuda.device_count()
    if (choice.index or 0) >= count:
        plural = "s" if count != 1 else ""
        return f"this machine has {count} CUDA GPU{plural} (cuda:0 to cuda:{count - 1})"
    return None


def device_label(device: torch.device) -> str:
    """``"CPU"`` or the GPU's name with its number (``"cuda:0 NVIDIA H200"``)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "CPU"
    return f"{device} {torch.cuda.get_device_name(device)}"


@dataclass(frozen=True)
class MemoryPart:
    """One share of a GPU's memory, as the memory panel draws it."""

    name: str
    size: int  # bytes
    what: str  # where the figure comes from, for a tooltip


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as torch sees it, in bytes: the driver's total and free
    (``torch.cuda.mem_get_info``), and what torch's allocator holds in tensors
    (``allocated``) and has reserved from the driver (``reserved`` >= ``allocated``)."""

    total: int
    free: int
    allocated: int
    reserved: int
    name: str = ""  # the GPU's name, "" when not known

    def parts(self, weights: int, kv: int) -> tuple[MemoryPart, ...]:
        """The device's memory split into what holds it, in drawing order; the sizes add
        up to ``total`` when the figures agree (weights and KV within ``allocated``)."""
        return (
            MemoryPart("weights", weights, "the model's tensors on the GPU"),
            MemoryPart("KV pages", kv, "the KV cache's page pool"),
            MemoryPart(
                "other",
                max(0, self.allocated - weights - kv),
                "other torch tensors: activations, CUDA-graph pools, kernels' scratch"
                " (torch.cuda.memory_allocated less weights and KV pages)",
            ),
            MemoryPart(
                "allocator reserve",
                max(0, self.reserved - self.allocated),
                "held by torch's caching allocator but in no tensor, reused without asking"
                " the driver (torch.cuda.memory_reserved less memory_allocated)",
            ),
            MemoryPart(
                "outside torch",
                max(0, self.total - self.free - self.reserved),
                "the CUDA context, compiled kernels and other processes on this GPU",
            ),
            MemoryPart("free", self.free, "free on the GPU (torch.cuda.mem_get_info)"),
        )

    def describe(self, weights: int, kv: int) -> str:
        """The status bar's words: weights, KV pages, the allocator's reserve beyond
        its tensors (activations, kernels' scratch, cached blocks), and what is free."""
        from engine.units import format_bytes

        def size(n: int) -> str:
            return format_bytes(n, binary=True)

        part = {p.name: p.size for p in self.parts(weights, kv)}
        return (
            f"VRAM: weights {size(weights)} · KV {size(kv)} · other {size(part['other'])}"
            f" · allocator reserve {size(part['allocator reserve'])}"
            f" · free {size(self.free)} of {size(self.total)}"
        )


class DeviceMemorySource(Protocol):
    """Reads a device's memory: :func:`device_memory` for the real GPU; a test hands the
    memory panel one that returns figures of its own (no GPU needed)."""

    def __call__(self, device: torch.device | str) -> DeviceMemory | None: ...


def device_memory(device: torch.device | str) -> DeviceMemory | None:
    """``device``'s memory, or None for the CPU (its memory is the process's)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        total=int(total),
        free=int(free),
        allocated=int(torch.cuda.memory_allocated(device)),
        reserved=int(torch.cuda.memory_reserved(device)),
        name=torch.cuda.get_device_name(device),
    )


def _device_arg(text: str) -> str:
    try:
        return str(parse_device(text))
    except DeviceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device`` on a command that loads a model; resolved before the model is read."""
    parser.add_argument(
        "--device",
        type=_device_arg,
        default=DEFAULT_DEVICE,
        help="auto (a CUDA GPU when there is one), cpu, cuda or cuda:N (default: auto)",
    )
    parser.set_defaults(resolve_device=True)  # engine.cli.main resolves it before loading
