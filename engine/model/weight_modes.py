"""How the loader keeps a GGUF file's weights (stdlib only: the command line imports it
before torch).

* ``native``: every weight as the file stores it, read in place from the mapped file
  (kernels/quant): resident bytes are the file's, loading maps it.
* ``int4``: Q4_0 / Q4_1 / Q4_K repacked for torch's int4 kernel, every other type fp32.
* ``bf16`` / ``dequant``: dense copies; ``dequant`` (fp32) is exact, what the
  transformers-equality tests load.
"""

WEIGHT_MODES = ("native", "int4", "bf16", "dequant")
DEFAULT_WEIGHT_MODE = "native"
