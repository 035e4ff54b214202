"""What `folio serve` and the app's Local server are asked to run: address, port, key and
limits. Standard library only, so the app can hold and check these without importing the
HTTP stack (uvicorn, Starlette) until a server actually starts."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


@dataclass(frozen=True)
class ServerSettings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: any free port (`Server.port` says which)
    api_key: str | None = None
    model_id: str | None = None  # the id clients send as "model"; default: the model's name
    max_tokens: int = 4096  # the most new tokens one request may ask for, per sample
    max_body_bytes: int = 8 << 20
    graceful_shutdown_s: float = 3.0  # streams still open then are closed

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a key or none")
        for name in ("max_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(settings: ServerSettings) -> str | None:
    """What to say when the server is reachable from other machines without a key."""
    if is_loopback(settings.host) or settings.api_key:
        return None
    return (
        f"serving on {settings.host} without an API key: anyone who can reach this machine "
        "can use the model. Give --api-key, or bind 127.0.0.1"
    )
