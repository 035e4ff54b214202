#!/usr/bin/env bash
# Folio's device check on a GPU machine: tools/device_check.py says what it runs and why.
# Needs python3 with torch, triton, numpy, numba and transformers, and .device_deps carried
# along (made on a development machine by `python tools/device_check.py --pack`).
# Writes $OUT/device_check.json; exit 0 done, 2 imports missing, 3 no GPU.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/.device_deps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
scratch="${TMPDIR:-/tmp}/folio-device-check"
export XDG_CACHE_HOME="$scratch/cache" FOLIO_DATA_DIR="$scratch/data"
export FOLIO_MODELS_DIR="$scratch/models" FOLIO_CONFIG_DIR="$scratch/config"
export FOLIO_KV_CACHE_DIR="$scratch/kv" TOKENIZERS_PARALLELISM=false
export TRITON_DEFAULT_FP_FUSION=1
export OUT="${OUT:-$PWD/device_check_out}"
exec timeout 470 "${PYTHON:-python3}" tools/device_check.py --out "$OUT" "$@"
