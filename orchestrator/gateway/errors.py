"""The gateway's errors, every one in OpenAI's shape (``openai_api.error``): ``ApiError`` carries the HTTP status
and the body's fields; ``api_error`` turns whatever a request raised into one. A verifier's gRPC status becomes the
status a REST client acts on (503 with ``Retry-After``: try again; 400: the request is wrong), and anything else is
a 500 that carries an incident id found in the log, never our internals."""
from __future__ import annotations

import logging
import uuid

import grpc
from fastapi.responses import JSONResponse

from tandem.edge.client import RemoteError

from . import openai_api

log = logging.getLogger("tandem.gateway")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(openai_api.error(self.message, self.type, self.param, self.code), self.status, headers)


# verifier status -> what the REST client is told
REMOTE = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "server_error", "verifier_busy"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "verifier_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "server_error", "verifier_unavailable"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "invalid_request"),
}


def api_error(e: BaseException, retry_after_s: int) -> ApiError:
    """``e`` as the error a REST client gets (``retry_after_s``: what a 503 tells it to wait)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RemoteError):
        status, type_, code = REMOTE.get(e.code, (502, "server_error", "verifier_error"))
        param = "response_format" if status == 400 and e.details.startswith("constraint") else None
        return ApiError(status, f"verifier: {e.details}", type_, code, param,
                        retry_after_s=retry_after_s if status == 503 else None)
    incident = uuid.uuid4().hex[:12]  # the log has the details; the client gets an id, not our internals
    log.error("request failed (incident %s)", incident, exc_info=e)
    return ApiError(500, f"internal error (incident {incident})", "server_error", "internal_error")


def unauthorized(message: str = "Incorrect or missing API key: send 'Authorization: Bearer <key>'.") -> ApiError:
    """The 401 of a request without a valid key."""
    return ApiError(401, message, code="invalid_api_key")
