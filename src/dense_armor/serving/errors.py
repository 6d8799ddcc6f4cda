"""OpenAI's error for a request refused: `ApiError` (the HTTP status, the error's type, the field
it names) and the error object the HTTP application answers with (`error_body`)."""

from typing import Any

__all__ = ["ApiError", "error_body"]


class ApiError(Exception):
    """A request refused: the HTTP `status`, OpenAI's error `type`, the field (`param`)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message,
            param,
            status,
            kind,
            code,
        )


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object for `error`."""
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.code,
        }
    }
