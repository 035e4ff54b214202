"""Folio's inference engine. The public surface, imported lazily so that `folio models`
and the installer do not pay for torch:

    from engine import Engine, JobRequest, SamplingSettings, CacheSettings, GeneratorSettings
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine.engine",
    "EngineSnapshot": "engine.engine",
    "JobHandle": "engine.engine",
    "JobRequest": "engine.generator.job",
    "JobResult": "engine.generator.job",
    "JobEvent": "engine.generator.job",
    "EventKind": "engine.generator.job",
    "SamplingSettings": "engine.generator.sampler",
    "GeneratorSettings": "engine.generator.settings",
    "CacheSettings": "engine.cache.kv_cache",
    "load_model": "engine.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
