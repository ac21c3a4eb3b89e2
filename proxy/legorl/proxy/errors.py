"""Errors the proxy answers with, and how each client format spells them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from legorl.api.trajectory import ApiFormat

__all__ = ["ErrorKind", "ProxyError", "error_body"]

ErrorKind = Literal[
    "invalid_request",  # 400: the harness sent something we cannot serve
    "not_found",  # 404: unknown route
    "method_not_allowed",  # 405
    "too_large",  # 413: body over the cap
    "context_overflow",  # 400: the prompt does not fit the engine's context window
    "engine_error",  # 502/503/504: the engine failed, timed out or stayed unavailable
    "proxy_error",  # 500: our own failure (journal write)
    "trial_finished",  # 409: the trial already ended; no more calls are served
]

_STATUS: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "context_overflow": 400,
    "engine_error": 502,
    "proxy_error": 500,
    "trial_finished": 409,
}

# Anthropic's documented error types; clients decide whether to retry from these and the status.
_ANTHROPIC_TYPE: dict[ErrorKind, str] = {
    "invalid_request": "invalid_request_error",
    "not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "too_large": "request_too_large",
    "context_overflow": "invalid_request_error",
    "engine_error": "api_error",
    "proxy_error": "api_error",
    "trial_finished": "invalid_request_error",
}

_OPENAI_TYPE: dict[ErrorKind, str] = {
    "invalid_request": "invalid_request_error",
    "not_found": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "too_large": "invalid_request_error",
    "context_overflow": "invalid_request_error",
    "engine_error": "server_error",
    "proxy_error": "server_error",
    "trial_finished": "invalid_request_error",
}


@dataclass
class ProxyError(Exception):
    """A failure to report to the harness in its own format."""

    kind: ErrorKind
    message: str
    status: int | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)
        if self.status is None:
            self.status = _STATUS[self.kind]

    @property
    def http_status(self) -> int:
        return self.status if self.status is not None else _STATUS[self.kind]


def error_body(api_format: ApiFormat | None, error: ProxyError) -> dict[str, Any]:
    """The error body a client of `api_format` expects (OpenAI's shape when unknown)."""
    if api_format == ApiFormat.ANTHROPIC_MESSAGES:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE[error.kind], "message": error.message}}
    code = "context_length_exceeded" if error.kind == "context_overflow" else error.kind
    return {
        "error": {
            "message": error.message,
            "type": _OPENAI_TYPE[error.kind],
            "param": error.param,
            "code": code,
        }
    }
