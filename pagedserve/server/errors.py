"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.request_body import UnsupportedField

logger = logging.getLogger("pagedserve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def _sendable(text: str | None) -> str | None:
    """`text` with lone surrogates (from a request's JSON escapes such as \\ud800, quoted in a
    message or naming a field) escaped: the body is sent as UTF-8, which cannot hold them."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _sendable(message), "type": _TYPES.get(status, "server_error"),
                      "param": _sendable(param), "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        unsupported = (first.get("ctx") or {}).get("error")
        if isinstance(unsupported, UnsupportedField):
            return error_response(400, str(unsupported), ".".join([*loc, unsupported.param]),
                                  getattr(unsupported, "code", "unsupported_field"))
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset)
            msg, param = "the request body is not valid JSON", None
        else:
            msg = "; ".join(_describe(err) for err in errors[:5])
        return error_response(400, msg, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, _parse_error(e) or str(e.detail),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(e).__name__}")


def _parse_error(e: StarletteHTTPException) -> str | None:
    """What was wrong with a body FastAPI could not parse (its own answer, "There was an error
    parsing the body", names nothing); None for other errors."""
    cause = e.__cause__
    if e.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply"
    if isinstance(cause, ValueError):  # e.g. an integer of more than 4,300 digits
        return f"the request body is not valid JSON: {cause}"
    return None


def _describe(err: dict) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
    msg = err.get("msg", "invalid value")
    if isinstance(err.get("input"), (bytes, bytearray)):  # (no JSON content type: raw bytes)
        return f"{loc}: the body was not read as JSON; send it with Content-Type: application/json"
    try:
        value = json.dumps(err.get("input"))[:80]
    except (TypeError, ValueError):
        value = "?"
    return f"{loc}: {msg} (got {value})"
