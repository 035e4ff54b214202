"""`folio cache stats|clear`, and the disk-cache options of `folio generate|chat|serve`.

The disk tier (engine/cache/disk_tier.py) is on by default in every command that runs a
model, at ``paths.kv_cache_dir()``: a second process finds the first one's pages.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine import paths
from engine.cache.disk_tier import delete_stores, list_stores
from engine.units import format_bytes


def add_disk_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--disk-cache",
        type=Path,
        default=None,
        help="where the prompt cache keeps pages on disk (default: the user cache folder)",
    )
    parser.add_argument(
        "--no-disk-cache", action="store_true", help="keep the prompt cache in memory only"
    )
    parser.add_argument(
        "--disk-cache-gb",
        type=float,
        default=None,
        help="the disk cache's budget per model (default: 4 GB, or 10%% of the free disk)",
    )


def disk_cache_settings(args: argparse.Namespace) -> dict[str, object]:
    """``CacheSettings`` fields (disk_dir, disk_bytes) for the options above."""
    if getattr(args, "no_disk_cache", False):
        return {"disk_dir": None, "disk_bytes": None}
    gb = getattr(args, "disk_cache_gb", None)
    if gb is not None and not gb > 0:
        raise ValueError(f"--disk-cache-gb must be more than 0, got {gb}")
    location = getattr(args, "disk_cache", None) or paths.kv_cache_dir()
    return {"disk_dir": str(location), "disk_bytes": int(gb * 1e9) if gb else None}


def add_cache_parser(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="the prompt cache on disk: stats, clear")
    csub = cache.add_subparsers(dest="cache_command", required=True)
    stats = csub.add_parser("stats", help="each model's store: pages and bytes")
    clear = csub.add_parser("clear", help="delete the stores (all, or one model's)")
    clear.add_argument("--model", type=Path, help="only this model file's store")
    for p in (stats, clear):
        p.add_argument("--disk-cache", type=Path, default=None, help="the location")
        p.add_argument("--json", action="store_true", help="one JSON object")


def run_cache(args: argparse.Namespace) -> int:
    location = args.disk_cache or paths.kv_cache_dir()
    if args.cache_command == "clear":
        model = args.model
        if model is not None and not model.exists():
            raise ValueError(f"{model}: no such model file (give the path it was loaded from)")
        freed, busy = delete_stores(location, model)
        if args.json:
            print(json.dumps({"location": str(location), "freed_bytes": freed, "in_use": busy}))
            return 0
        print(f"freed {format_bytes(freed)} in {location}")
        if busy:
            print(f"{busy} store(s) left: a running Folio process is using them; quit it first")
        return 0
    stores = list_stores(location)
    if args.json:
        rows = [
            {
                "model": s.model,
                "path": s.model_path,
                "pages": s.pages,
                "bytes": s.bytes,
                "in_use": s.in_use,
                "directory": str(s.directory),
            }
            for s in stores
        ]
        print(json.dumps({"location": str(location), "stores": rows}))
        return 0
    if not stores:
        print(f"no disk cache in {location}")
        return 0
    print(f"disk cache in {location}:")
    for s in stores:
        pages = "?" if s.pages is None else str(s.pages)
        busy = " (in use)" if s.in_use else ""
        print(f"  {s.model or s.directory.name}: {pages} pages, {format_bytes(s.bytes)}{busy}")
    total = sum(s.bytes for s in stores)
    print(f"  total {format_bytes(total)} in {len(stores)} store(s)")
    return 0
