"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.responses import Response

__all__ = ["REFUSAL_CODE", "APIError", "error_response", "from_config_error", "from_validation_error"]

#: the ``code`` of a guardrail refusal, as OpenAI's and plyx-safety's (``refusal()`` there): the rule that fired
#: travels beside it as ``rule_id``
REFUSAL_CODE = "content_policy_violation"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client (never raised past the app).

    Attributes:
        status: HTTP status. message: what is wrong and how to fix it. param: the request field, or None.
        code: OpenAI's machine-readable code (``model_not_found``, ``context_length_exceeded``...).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.extra = extra or {}  # fields beyond OpenAI's four (a guardrail refusal's ``rule_id``)

    def body(self) -> dict[str, Any]:
        return {"error": {**self.extra, "message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(err.body()), status_code=err.status, media_type="application/json",
                    headers=headers)


_PATH = re.compile(r" - at `\$\.?([^`]*)`")


def _param(path: str) -> str | None:
    path = path.split("[", 1)[0] if path.startswith("[") else path
    return path or None


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError | UnicodeDecodeError) -> APIError:
    """A msgspec error (``Expected `int`, got `str` - at `$.max_tokens```), or a body that is not UTF-8, as a
    400 naming the field."""
    text = str(exc)
    m = _PATH.search(text)
    param = _param(m.group(1)) if m else None
    unknown = re.search(r"unknown field `([^`]+)`", text)
    if unknown:
        field = unknown.group(1)
        param = f"{param}.{field}" if param else field
        return APIError(400, f"Unrecognized request argument supplied: {field}", param=param,
                        code="unknown_parameter")
    if isinstance(exc, UnicodeDecodeError):  # msgspec decodes strings lazily and lets this one through
        return APIError(400, f"The request body is not valid UTF-8 ({exc.reason}: byte {exc.object[exc.start:exc.end]!r} "
                        f"at offset {exc.start}). Send JSON encoded as UTF-8 with Content-Type: application/json",
                        code="invalid_json")
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"The request body is not valid JSON: {text}. Send a JSON object "
                        "with Content-Type: application/json", code="invalid_json")
    return APIError(400, f"Invalid request: {text}", param=param, code="invalid_value")


#: SamplingParams field -> the OpenAI request field it came from
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "structured": "response_format", "logprobs": "logprobs"}


def from_config_error(exc: Any) -> APIError:
    """A plyx ``ConfigError`` (``SamplingParams.top_p must be in (0, 1]``) as a 400 naming the request field."""
    path = getattr(exc, "path", "") or ""
    field = path.split(".", 1)[1] if "." in path else path
    field = field.split("[", 1)[0].split(".", 1)[0]
    return APIError(400, str(exc), param=_PARAM_NAMES.get(field, field) or None, code="invalid_value")
