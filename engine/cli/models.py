"""`folio models ...`: the model manager on the command line, on the same logic as the GUI.

folio models search [QUERY] [--sort downloads|likes|updated] [--format gguf|safetensors]
folio models files REPO [--context N] [--kv-bits B] [--page-size P] [--device cpu|cuda]
folio models download REPO [FILE]
folio models list
folio models delete MODEL          (a path or a name from `folio models list`)
folio models import PATH
folio models token [TOKEN | --clear]
folio models fetch-default
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from engine.units import format_bytes

EXIT_FAILED = 1
_SORTS = {"downloads": "downloads", "likes": "likes", "updated": "last_modified"}


def add_models_parser(subparsers) -> argparse.ArgumentParser:
    models = subparsers.add_parser("models", help="find, download and manage models")
    msub = models.add_subparsers(dest="models_command", required=True)

    search = msub.add_parser("search", help="search the Hugging Face Hub")
    search.add_argument("query", nargs="?", default="")
    search.add_argument("--sort", choices=tuple(_SORTS), default="downloads")
    search.add_argument("--format", dest="fmt", choices=("gguf", "safetensors"), default="gguf")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true")

    files = msub.add_parser("files", help="a repository's models: quantization, size, fit")
    files.add_argument("repo")
    files.add_argument(
        "--context", type=int, default=4096, help="context length for the fit (tokens)"
    )
    files.add_argument("--page-size", type=int, default=16)
    files.add_argument(
        "--kv-bits", type=int, choices=range(2, 9), default=None, help="quantized KV cache bits"
    )
    files.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    files.add_argument(
        "--no-peek", action="store_true", help="do not read a GGUF header for layer counts"
    )
    files.add_argument("--json", action="store_true")

    download = msub.add_parser("download", help="download a GGUF file (or a safetensors folder)")
    download.add_argument("repo")
    download.add_argument(
        "file", nargs="?", help="the .gguf file; omit for a safetensors repository"
    )
    download.add_argument("--quiet", action="store_true", help="no progress on stderr")

    lst = msub.add_parser("list", help="models on this machine")
    lst.add_argument("--no-hf-cache", action="store_true", help="skip the Hugging Face cache")
    lst.add_argument("--json", action="store_true")

    delete = msub.add_parser("delete", help="delete a model from disk")
    delete.add_argument("model", help="a path or a name from `folio models list`")

    imp = msub.add_parser("import", help="add a local .gguf file or model folder to the list")
    imp.add_argument("path", type=Path)

    token = msub.add_parser("token", help="store the Hugging Face access token (for gated models)")
    token.add_argument("value", nargs="?")
    token.add_argument("--clear", action="store_true")

    msub.add_parser(
        "fetch-default", help="make sure the default model is on disk and print its path"
    )
    return models


def run_models(args: argparse.Namespace) -> int:
    from engine.hub.errors import HubError

    command = args.models_command
    try:
        if command == "fetch-default":
            from engine.model.fetch import ensure_default_model

            print(ensure_default_model())
            return 0
        handler = {
            "search": _search,
            "files": _files,
            "download": _download,
            "list": _list,
            "delete": _delete,
            "import": _import,
            "token": _token,
        }[command]
        return handler(args)
    except HubError as exc:
        print(f"folio: {exc}", file=sys.stderr)
        return EXIT_FAILED


# --------------------------------------------------------------------------- formatting


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    return "\n".join(lines)


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return obj


# --------------------------------------------------------------------------- commands


def _search(args: argparse.Namespace) -> int:
    from engine.hub.remote import search_models

    results = search_models(args.query, sort=_SORTS[args.sort], fmt=args.fmt, limit=args.limit)
    if args.json:
        print(json.dumps(_jsonable(results)))
        return 0
    if not results:
        print("no models found")
        return 0
    rows = [
        [
            r.repo_id,
            f"{r.downloads:,}" if r.downloads is not None else "?",
            f"{r.likes:,}" if r.likes is not None else "?",
            r.last_modified.date().isoformat() if r.last_modified else "?",
            "gated" if r.gated else "",
        ]
        for r in results
    ]
    print(_table(rows, ["REPOSITORY", "DOWNLOADS", "LIKES", "UPDATED", ""]))
    return 0


def _files(args: argparse.Namespace) -> int:
    from engine.hub.errors import HubError
    from engine.hub.fit import CachePlan
    from engine.hub.remote import (
        ModelShape,
        candidate_fit,
        confirm_quant,
        fetch_hf_config,
        list_repo_models,
        peek_gguf,
        shape_from_hf_config,
        shape_from_summary,
    )

    plan = CachePlan(
        context_tokens=args.context,
        page_size=args.page_size,
        k_bits=args.kv_bits,
        v_bits=args.kv_bits,
    )
    listing = list_repo_models(args.repo)
    candidates = list(listing.candidates)
    dims: ModelShape | None = None
    peeked: dict[str, ModelShape] = {}
    notes: dict[str, str] = {}
    if not args.no_peek:
        # Quantizations of one repository share layers and heads: one header read serves all.
        first = next((c for c in candidates if c.kind == "gguf" and c.supported), None)
        try:
            if first is not None:
                summary = peek_gguf(listing.repo_id, first.name, revision=listing.revision)
                candidates = [confirm_quant(c, summary) if c is first else c for c in candidates]
                peeked[first.name] = shape_from_summary(summary)
                dims = dataclasses.replace(peeked[first.name], weight_bytes=None)
            folder = next((c for c in candidates if c.kind == "safetensors"), None)
            if folder is not None:
                cfg = fetch_hf_config(listing.repo_id, revision=listing.revision)
                peeked[folder.name] = shape_from_hf_config(cfg, None)
        except HubError as exc:
            notes["*"] = f"header not read ({exc})"
    rows, out = [], []
    for c in candidates:
        shape = peeked.get(c.name, dims if c.kind == "gguf" else None)
        fit_text, fit_label, fit_note = "", "", ""
        if c.supported:
            fit = candidate_fit(c, shape, plan, args.device, parameters=listing.parameters)
            fit_label, fit_text, fit_note = fit.label.value, fit.text, fit.note
        quant = (c.quant or "?") + (" (checked)" if c.quant_confirmed else "")
        rows.append([c.name, c.kind, quant, format_bytes(c.size), fit_label or "-", c.problem or fit_note])
        out.append({**_jsonable(c), "fit": fit_label or None, "fit_text": fit_text or None})
    if args.json:
        print(json.dumps({"repo_id": listing.repo_id, "revision": listing.revision, "models": out}))
        return 0
    if not rows:
        print(f"{listing.repo_id} holds no GGUF files or safetensors model")
        return 0
    print(f"{listing.repo_id} @ {listing.revision[:12]}  (fit for {plan.context_tokens} tokens"
          f"{f', {args.kv_bits}-bit KV' if args.kv_bits else ''} on {args.device})")  # fmt: skip
    print(_table(rows, ["NAME", "FORMAT", "QUANT", "SIZE", "FIT", "NOTE"]))
    if "*" in notes:
        print(f"note: {notes['*']}", file=sys.stderr)
    return 0


def _stderr_progress():
    last = [0.0]

    def report(p) -> None:
        now = time.monotonic()
        if p.state.value in ("downloading", "verifying") and now - last[0] < 0.5:
            return
        last[0] = now
        pct = f" ({p.fraction * 100:3.0f}%)" if p.fraction is not None else ""
        speed = f"  {p.bytes_per_s / 1e6:.1f} MB/s" if p.bytes_per_s else ""
        eta = (
            f"  ETA {p.eta_s:.0f} s"
            if p.eta_s is not None and p.state.value == "downloading"
            else ""
        )
        print(f"  {p.state.value}: {format_bytes(p.done_bytes)} of {format_bytes(p.total_bytes)}{pct}{speed}{eta}",
              file=sys.stderr, flush=True)  # fmt: skip

    return report


def _download(args: argparse.Namespace) -> int:
    from engine.hub.errors import UnsupportedModelError
    from engine.hub.remote import list_repo_models
    from engine.hub.transfer import download_model

    listing = list_repo_models(args.repo)
    if args.file:
        candidate = listing.candidate(args.file)
    else:
        folders = [c for c in listing.candidates if c.kind == "safetensors"]
        if not folders:
            names = ", ".join(c.name for c in listing.candidates) or "none"
            print(
                f"folio: name the file to download; models in {listing.repo_id}: {names}",
                file=sys.stderr,
            )
            return EXIT_FAILED
        candidate = folders[0]
    if candidate.problem:
        raise UnsupportedModelError(f"{candidate.name}: {candidate.problem}")
    path = download_model(candidate, progress=None if args.quiet else _stderr_progress())
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    from engine.hub.library import list_local_models

    models = list_local_models(include_hf_cache=not args.no_hf_cache)
    if args.json:
        print(json.dumps(_jsonable(models)))
        return 0
    if not models:
        print("no models yet: try `folio models fetch-default` or `folio models search`")
        return 0
    rows = [
        [
            m.name,
            m.format,
            m.quant or "?",
            m.architecture or "?",
            format_bytes(m.size_bytes),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(m.last_used))
            if m.last_used
            else "never",
            m.source,
            m.problem or str(m.path),
        ]
        for m in models
    ]
    print(
        _table(
            rows,
            ["NAME", "FORMAT", "QUANT", "ARCH", "SIZE", "LAST USED", "SOURCE", "PATH / PROBLEM"],
        )
    )
    return 0


def _delete(args: argparse.Namespace) -> int:
    from engine.hub.library import delete_model, list_local_models

    models = list_local_models()
    target = Path(args.model).expanduser()
    matches = [m for m in models if m.path.absolute() == target.absolute()] or [
        m for m in models if args.model in (m.name, m.path.name)
    ]
    if not matches:
        print(f"folio: no model named {args.model!r}; see `folio models list`", file=sys.stderr)
        return EXIT_FAILED
    if len(matches) > 1:
        paths = "\n  ".join(str(m.path) for m in matches)
        print(
            f"folio: {args.model!r} matches several models; give the path:\n  {paths}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(delete_model(matches[0]).message)
    return 0


def _import(args: argparse.Namespace) -> int:
    from engine.hub.library import import_model

    model = import_model(args.path)
    print(
        f"imported {model.name} ({model.format}, {model.architecture}, {model.quant or '?'}): {model.path}"
    )
    return 0


def _token(args: argparse.Namespace) -> int:
    from engine.hub.token import clear_token, save_token

    if args.clear:
        clear_token()
        print("token removed")
        return 0
    value = args.value
    if value is None:
        import getpass

        value = getpass.getpass("Hugging Face access token: ")
    saved = save_token(value)
    print(f"token stored ({saved.where})")
    if saved.warning:
        print(f"warning: {saved.warning}", file=sys.stderr)
    return 0
