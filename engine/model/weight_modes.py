"""How the loader keeps a GGUF file's weights (stdlib only: the command line imports it
before torch).

* ``native``: every weight as the file stores it, read in place from the mapped file
  (kernels/quant): resident bytes are the file's, loading maps it.
* ``int4``: Q4_0 / Q4_1 / Q4_K repacked for torch's int4 kernel, every other type fp32.
* ``bf16`` / ``dequant``: dense copies; ``dequant`` (fp32) is exact, what the
  transformers-equality tests load.
"""

import math

WEIGHT_MODES = ("native", "int4", "bf16", "dequant")
DEFAULT_WEIGHT_MODE = "native"

# The modes a user picks from in the app, least memory first (``int4`` is a bench and
# command-line mode: the native kernels beat it on every CPU measured).
USER_WEIGHT_MODES = ("native", "bf16", "dequant")


def resident_weight_bytes(tensors, mode: str) -> int:
    """Bytes the loader keeps for a GGUF file's weights in `mode`, from its tensor
    directory alone: `tensors` yields ``(name, shape, file_bytes)``.

    Vectors (norms, biases) are fp32 in every mode. ``native`` keeps every matrix as the
    file stores it; ``dequant`` keeps fp32 copies; ``bf16`` keeps bf16 copies of the
    projections and an fp32 embedding table. A tied head reads the embedding table and
    costs nothing more. ``int4`` depends on which blocks torch's kernel takes and is not
    estimated here.
    """
    if mode not in USER_WEIGHT_MODES:
        raise ValueError(f"resident bytes are estimated for native, bf16 and dequant, not {mode!r}")
    total = 0
    for name, shape, file_bytes in tensors:
        if name == "rope_freqs.weight":
            continue  # rotary factors, not a weight the model counts
        numel = math.prod(shape)
        if len(shape) < 2:
            total += 4 * numel
        elif mode == "native":
            total += file_bytes
        elif mode == "dequant" or name == "token_embd.weight":
            total += 4 * numel
        else:
            total += 2 * numel
    return total
