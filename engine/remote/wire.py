"""A page-table snapshot as JSON, both ways: `GET /folio/v1/cache` answers with
`snapshot_json(engine.snapshot())`, and a remote client turns it back into the
`EngineSnapshot` the memory views draw with `snapshot_from_json`.

Only the device pool travels (states, ref counts, fills, hash prefixes, parents, owners,
tokens, eviction order, prefix counters) and the jobs with their request ids, so a client
can tell its own requests from other clients'. The host and disk tiers stay on the
server: their figures are in `/metrics`, their pages are not drawn remotely.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine.cache.snapshot import CacheSnapshot, cache_stats
from engine.engine import EngineSnapshot, JobInfo

FORMAT = 1  # bumped when a field changes meaning


def snapshot_json(snap: EngineSnapshot) -> dict[str, Any]:
    cache = snap.cache
    held = (cache.hash_prefix != 0) | (cache.fill > 0)
    tokens = {
        str(page): list(snap.page_tokens[page][: int(cache.fill[page])])
        for page in np.flatnonzero(held).tolist()
        if page < len(snap.page_tokens)
    }
    return {
        "format": FORMAT,
        "version": snap.version,
        "page_size": snap.page_size,
        "num_pages": snap.num_pages,
        "state": cache.state.tolist(),
        "ref_count": cache.ref_count.tolist(),
        "fill": cache.fill.tolist(),
        "access_serial": cache.access_serial.tolist(),
        "hash_prefix": [str(h) for h in cache.hash_prefix.tolist()],  # uint64: strings
        "edges": cache.edges.tolist(),
        "owners": {str(p): list(o) for p, o in enumerate(cache.owners) if o},
        "tokens": tokens,
        "eviction_next": list(snap.eviction_next),
        "counters": dict(cache.counters),
        "seq_jobs": {str(s): j for s, j in snap.seq_jobs.items()},
        "jobs": [_job_json(j) for j in snap.jobs],
        "cache_bytes": snap.cache_bytes,
    }


def _job_json(job: JobInfo) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "tag": None if job.tag is None else str(job.tag),
        "request_id": getattr(job.tag, "request_id", None),
        "state": job.state,
        "prompt_tokens": job.prompt_tokens,
        "new_tokens": job.new_tokens,
        "cached_tokens": job.cached_tokens,
        "skips": job.skips,
        "wait_reason": job.wait_reason,
        "sequences": list(job.sequences),
        "pages": job.pages,
    }


def snapshot_from_json(
    data: dict[str, Any], tag_of: Any = None, version: int | None = None, note: str = ""
) -> EngineSnapshot:
    """The snapshot `data` describes. ``tag_of(job)`` gives a job's tag on this side (a
    request this client sent maps to its chat; the default keeps the server's words).
    ValueError when ``data`` is not a snapshot of this format."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("the server's cache snapshot is not in a format this Folio reads")
    n = int(data["num_pages"])
    state = np.asarray(data["state"], np.uint8)
    if len(state) != n:
        raise ValueError(f"the cache snapshot has {len(state)} page states for {n} pages")
    fill = np.asarray(data["fill"], np.int32)
    edges = np.asarray(data["edges"], np.int32).reshape(-1, 2)
    owners: list[tuple[int, ...]] = [()] * n
    for page, who in data["owners"].items():
        owners[int(page)] = tuple(int(s) for s in who)
    page_tokens: list[list[int]] = [[] for _ in range(n)]
    for page, ids in data["tokens"].items():
        page_tokens[int(page)] = [int(t) for t in ids]
    cache = CacheSnapshot(
        state=state,
        ref_count=np.asarray(data["ref_count"], np.int32),
        fill=fill,
        tier=np.zeros(n, np.uint8),
        access_serial=np.asarray(data["access_serial"], np.int64),
        owners=owners,
        hash_prefix=np.asarray([int(h) for h in data["hash_prefix"]], np.uint64),
        edges=edges,
        host=None,
        counters={k: int(v) for k, v in data["counters"].items()},
    )
    tag_of = tag_of or (lambda job: job.get("tag"))
    jobs = [
        JobInfo(
            job_id=int(j["job_id"]),
            tag=tag_of(j),
            state=str(j["state"]),
            prompt_tokens=int(j["prompt_tokens"]),
            new_tokens=int(j["new_tokens"]),
            cached_tokens=int(j["cached_tokens"]),
            skips=int(j["skips"]),
            wait_reason=str(j["wait_reason"]),
            sequences=tuple(int(s) for s in j["sequences"]),
            pages=int(j["pages"]),
        )
        for j in data["jobs"]
    ]
    page_size = int(data["page_size"])
    return EngineSnapshot(
        version=int(data["version"]) if version is None else version,
        time=time.monotonic(),
        cache=cache,
        stats=cache_stats(cache, page_size),
        page_size=page_size,
        num_pages=n,
        page_tokens=page_tokens,
        eviction_next=[int(p) for p in data["eviction_next"]],
        jobs=jobs,
        seq_jobs={int(s): int(j) for s, j in data["seq_jobs"].items()},
        job_tags={j.job_id: j.tag for j in jobs},
        cache_bytes=int(data.get("cache_bytes", 0)),
        host_bytes=0,
        note=note,
    )
