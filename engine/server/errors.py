"""OpenAI-style error objects: what every refusal of the server looks like on the wire.

A client reads `{"error": {"message", "type", "param", "code"}}` and the status code; the
official clients turn the status into an exception class (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413 and 422 their own). The message says what to
change, as every error of the engine does.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses (or could not answer), as the client should see it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    """A parameter with a value the server does not take (422)."""
    return APIError(422, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    return APIError(
        422,
        f"{param}{what} is not supported by this server yet: leave it out",
        param=param,
        code="unsupported_parameter",
    )


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) in the same shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"there is no {request.method} {request.url.path}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
        code = "not_found"
    elif exc.status_code == 405:
        message = f"{request.url.path} does not take {request.method}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """A client that left while its body was being read: nobody reads the answer."""
    return Response(status_code=499)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(
        500, f"the server failed on this request: {exc}", code="internal_error"
    ).response()
