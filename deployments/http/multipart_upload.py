"""A multipart upload read as it arrives (POST /v1/files, the audio routes): its small fields kept,
its one file's bytes handed on a piece at a time, and the body refused (413) the moment the file
passes its limit. Starlette's `request.form()` writes a whole file part to a temporary file before the route
sees it, so a body with no Content-Length (chunked) was read and spooled whole before its size
was known; here nothing past the limit is read, spooled or stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .openai import ApiError

try:
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header
except ModuleNotFoundError:  # python-multipart before 0.0.13 (the serve extra allows 0.0.9)
    from multipart.exceptions import FormParserError
    from multipart.multipart import MultipartParser, parse_options_header


@dataclass
class Upload:
    """What an upload's form held: its fields' text (each name's values in order: `get` the
    first, `getlist` all, as Starlette's FormData), its file's name (None: no file part) and size."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    complete: bool = False  # the file part ended (the body did not stop inside it)

    def get(self, name: str, default=None):
        values = self.fields.get(name)
        return values[0] if values else default

    def getlist(self, name: str) -> list[str]:
        return list(self.fields.get(name, ()))


class _Parts:
    """python-multipart's callbacks over one form: each part's Content-Disposition, then its data,
    kept as the events the reader acts on after each chunk (`take`). The file part is the part
    named `name` with a filename; its data past `most` bytes, or the other parts' past
    `field_bytes` together, raise a 413 at once."""

    def __init__(self, name: str, most: int, field_bytes: int, too_large):
        self.name, self.most, self.field_bytes, self.too_large = name, most, field_bytes, too_large
        self.upload, self.events = Upload(), []
        self._header, self._value, self._disposition = b"", b"", b""
        self._kind, self._part_name, self._text, self._field_used = None, "", bytearray(), 0

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data, "on_part_end": self._end}

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def _begin(self) -> None:
        self._header, self._value, self._disposition, self._text = b"", b"", b"", bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._part_name = _text(options.get(b"name", b""))
        filename = options.get(b"filename")
        if filename is None:
            self._kind = "field"
        elif self._part_name == self.name:
            if self.upload.filename is not None:
                raise ApiError(400, f"{self.name}: one file per upload", param=self.name)
            self._kind, self.upload.filename = "file", _text(filename) or "file"
            self.events.append(("begin", self.upload.filename))
        else:
            self._kind = "other"  # a file of another name: read past, counted as the form's

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._kind == "file":
            self.upload.size += end - start
            if self.upload.size > self.most:
                raise self.too_large(f"the file has more than {self.most} bytes")
            self.events.append(("data", data[start:end]))
            return
        self._field_used += end - start
        if self._field_used > self.field_bytes:
            raise self.too_large(f"the form's other parts have more than {self.field_bytes} bytes")
        if self._kind == "field":
            self._text += data[start:end]

    def _end(self) -> None:
        if self._kind == "file":
            self.upload.complete = True
            self.events.append(("end", None))
        elif self._kind == "field":
            self.upload.fields.setdefault(self._part_name, []).append(_text(bytes(self._text)))


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


async def read_upload(request, name: str, most: int, field_bytes: int, begin, write, piece_bytes: int,
                      too_large) -> Upload:
    """Read `request`'s multipart body as it comes: the part `name` with a filename is the file,
    `await begin(filename)` at its headers, then `await write(piece)` for each piece of at most
    `piece_bytes`; the other parts are fields (their text kept). Refused: 400 naming `name` for a
    body that is no multipart form, a broken one or a second file; `too_large(what)`
    (an ApiError to raise: 413) the moment the file passes `most` bytes or the other parts
    `field_bytes`, before the rest of the body is read."""
    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not request.headers.get("content-type", "").startswith("multipart/form-data") or not boundary:
        raise ApiError(400, f"{name}: the body must be multipart/form-data with a {name}", param=name)
    parts = _Parts(name, most, field_bytes, too_large)
    parser, buffer = MultipartParser(boundary, parts.callbacks()), bytearray()

    async def act(events) -> None:
        for kind, value in events:
            if kind == "begin":
                await begin(value)
            elif kind == "data":
                buffer.extend(value)
            while buffer and (len(buffer) >= piece_bytes or kind == "end"):
                piece = bytes(buffer[:piece_bytes])
                del buffer[:piece_bytes]
                await write(piece)

    try:
        async for chunk in request.stream():
            parser.write(chunk)
            await act(parts.take())
        parser.finalize()
    except FormParserError as e:
        raise ApiError(400, f"{name}: the body must be multipart/form-data with a {name}: {e}"[:300],
                       param=name) from None
    await act(parts.take())
    upload = parts.upload
    if upload.filename is not None and not upload.complete:
        raise ApiError(400, f"{name}: the body ended inside the file (an upload cut short)", param=name)
    return upload
