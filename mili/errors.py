"""Errors a user can cause, typed so each layer can map them (the server maps them to HTTP codes).

Every user-facing error derives from ``ValueError`` (bad input) or ``RuntimeError`` (state), and
carries the parameter it is about, so a client is told exactly what to fix.
"""

from __future__ import annotations


class MiliError(Exception):
    """Base of every error MILI raises on purpose."""

    param: str | None = None
    code: str | None = None


class InvalidRequest(MiliError, ValueError):
    """A request parameter is out of range or of the wrong kind."""

    code = "invalid_parameter"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ChatTemplateError(InvalidRequest):
    """The chat template refused a conversation (its own rules: which roles, in which order...)."""

    code = "chat_template_error"

    def __init__(self, message: str):
        super().__init__(message, param="messages")


class NotContinuable(InvalidRequest):
    """continue_final_message asked of a conversation whose final message is not an assistant's text."""

    code = "final_message_not_continuable"

    def __init__(self, message: str):
        super().__init__(message, param="messages")


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the tokens asked for) does not fit the model's context or the KV pool."""

    code = "context_length_exceeded"


class ModelLoadError(MiliError, ValueError):
    """A model path, hub id, architecture or checkpoint that cannot be loaded."""

    code = "model_load_error"

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message)
        self.param = param


class EngineDeadError(MiliError, RuntimeError):
    """The engine stopped (a bug, an out-of-memory error, its process killed): nothing more is served."""

    code = "engine_dead"


class RequestFailed(MiliError, RuntimeError):
    """One request failed while running (sampling or checking its token, its grammar, its detokenization):
    it ended with this error, and the engine goes on serving the others."""

    code = "request_failed"
