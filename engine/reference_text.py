"""The reference text: Python's own `pydoc_data.topics` (English prose about Python, shipped
with every Python), so that figures measured on it reproduce anywhere. Perplexity is
measured from its beginning (engine/perplexity.py); a quantized K cache's key means are
calibrated on its middle (engine/model/calibration.py); the batched bench feeds it as
prompts."""

from __future__ import annotations


def reference_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
