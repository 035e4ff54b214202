"""The tag of every job the server submits (`JobRequest.tag`)."""

from __future__ import annotations

from dataclasses import dataclass, field

API_LABEL = "API"


@dataclass(frozen=True)
class ApiTag:
    """Every API job's tag. Tags compare and hash equal whatever the request, so views that
    colour pages and queue rows by tag (the GUI's `ChatColors`) give all API jobs one colour,
    named "API"; `request_id` (left out of comparisons) says which request a job serves and
    is how the server routes the job's events back to that request."""

    request_id: str = field(default="", compare=False)

    def __str__(self) -> str:
        return API_LABEL
