"""The errors a request gets from the serving layer, each carrying what the HTTP answer needs as
data: a RequestError its field (HTTP 400 naming it), an Overloaded request its status (503: the
engine front's own type, one from the queue to the route)."""

from __future__ import annotations

from generation.front import Finish, Overloaded, rejected


class RequestError(ValueError):
    """A request the serving layer refuses: `field` names the GenerateRequest's field that was
    wrong ("prompt", "messages.0.content.1", "settings.top_k"; HTTP 400), None where no field is
    to blame; `predicate` what the message says of it after its name, where the engine front
    gave one (generation.front.Refused: an OpenAI route then puts its own name for the field
    before it). Always given by the raiser, never read back from the message. `status`: its HTTP
    status wherever it becomes an answer (errors.refusal, the ingress's calls)."""

    status = 400

    def __init__(self, message: str, field: str | None, predicate: str | None = None):
        super().__init__(message)
        self.field, self.predicate = field, predicate

    def __reduce__(self):  # crosses Ray's process boundary intact
        return type(self), (str(self), self.field, self.predicate)


class NotFound(RequestError):
    """A request names a stored thing that is not there: an unknown or deleted file or batch, a
    LoRA adapter not loaded (HTTP 404 naming the field that named it)."""

    status = 404


def refusal(error: RequestError | Overloaded) -> Finish:
    """How a refusal crosses the Ray hop from the decoder, whatever the verb: the engine front's
    "rejected" Finish (503 for a full queue, else 400 naming the field), an answer rather than
    an exception (which a replica would log as its own failure)."""
    if isinstance(error, Overloaded):
        return rejected(str(error), 503)
    return rejected(str(error), error.status, error.field, getattr(error, "predicate", None))
