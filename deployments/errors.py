"""The errors a request gets from the serving layer, each carrying what the HTTP answer needs as
data: a RequestError its field (HTTP 400 naming it), an Overloaded request its status (503)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the serving layer refuses: `field` names the GenerateRequest's field that was
    wrong ("prompt", "messages.0.content.1", "settings.top_k"; HTTP 400), None where no field is
    to blame. Always given by the raiser, never read back from the message."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # crosses Ray's process boundary intact
        return type(self), (str(self), self.field)


class Overloaded(RuntimeError):
    """The decoder's queue is full (HTTP 503 with Retry-After)."""
