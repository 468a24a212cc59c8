"""The files of /v1/files: the batch inputs clients upload and the output and error files the
batches write, in a folder (deployments.app.Batches holds one store, every ingress replica
reaches it by handle).

A file is two entries in the folder: its bytes (`file-ID.data`) and its record (`file-ID.json`,
OpenAI's file object), each written whole (a `.part` renamed into place), so a store that
restarts reads back every file that was finished and none that was not. An upload arrives in
pieces (`begin`, `append`, `finish`): the bytes travel between replicas a piece at a time, never
as one message of the whole file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from ..errors import NotFound, RequestError

logger = logging.getLogger("ray.serve")
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")  # what may name a file in the folder


class FileStore:
    """Files by id in `folder` (see the module docstring). Records are plain dicts: OpenAI's file
    object (id, object, bytes, created_at, filename, purpose, status)."""

    def __init__(self, folder: Path, clock=time.time):
        self.folder, self.clock = folder, clock
        self.records: dict[str, dict] = {}
        self.uploads: dict[str, int] = {}  # file id -> bytes received, while its upload runs
        folder.mkdir(parents=True, exist_ok=True)
        self._load()

    # -- uploads ----------------------------------------------------------------------------------
    def begin(self, filename: str, purpose: str, size: int) -> str:
        """A new file of `size` bytes, its pieces to come (`append`, then `finish`)."""
        file_id = new_file_id()
        self.records[file_id] = {"id": file_id, "object": "file", "bytes": size, "created_at": int(self.clock()),
                                 "filename": filename, "purpose": purpose, "status": "uploaded",
                                 "expires_at": None, "status_details": None}
        self.uploads[file_id] = 0
        self._data(file_id, ".upload").write_bytes(b"")
        return file_id

    def append(self, file_id: str, piece: bytes) -> None:
        received, size = self._upload(file_id) + len(piece), self.records[file_id]["bytes"]
        if received > size:
            self.abort(file_id)
            raise RequestError(f"file: more bytes came than the {size} announced", "file")
        with self._data(file_id, ".upload").open("ab") as out:
            out.write(piece)
        self.uploads[file_id] = received

    def finish(self, file_id: str) -> dict:
        """The upload whole: the file kept (its record returned), or refused when bytes are missing."""
        received, record = self._upload(file_id), self.records[file_id]
        if received != record["bytes"]:
            self.abort(file_id)
            raise RequestError(f"file: the upload ended after {received} of {record['bytes']} bytes", "file")
        os.replace(self._data(file_id, ".upload"), self._data(file_id))
        del self.uploads[file_id]
        record["status"] = "processed"
        self._write(record)
        return record

    def abort(self, file_id: str) -> None:
        """An upload that will not finish (its client left, its ingress replica went away)."""
        if self.uploads.pop(file_id, None) is not None:
            self.records.pop(file_id, None)
            self._data(file_id, ".upload").unlink(missing_ok=True)

    def adopt(self, path: Path, file_id: str, filename: str, purpose: str) -> dict:
        """A file written elsewhere in the folder's file system (a batch's output) kept under
        `file_id`, moved in whole; the record it already has where it was adopted before."""
        if file_id in self.records:
            return self.records[file_id]
        record = {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": int(self.clock()),
                  "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                  "status_details": None}
        os.replace(path, self._data(file_id))
        self.records[file_id] = record
        self._write(record)
        return record

    # -- reading ----------------------------------------------------------------------------------
    def get(self, file_id: str, param: str = "file_id") -> dict:
        """The record of a finished file; NotFound naming `param` for any other id."""
        record = self.records.get(file_id)
        if record is None or file_id in self.uploads:
            raise NotFound(f"{param}: no file '{file_id[:256]}' (unknown or deleted)", param)
        return record

    def path(self, file_id: str) -> Path:
        self.get(file_id)
        return self._data(file_id)

    def read(self, file_id: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of the file from `offset` (b"" past its end)."""
        with self.path(file_id).open("rb") as data:
            data.seek(offset)
            return data.read(size)

    def page(self, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        """OpenAI's list of files: in the order they were made (`order`), those of `purpose`, after the file
        `after` (a cursor: 400 where it is not one of them), at most `limit`."""
        found = [r for r in self.records.values() if r["id"] not in self.uploads
                 and (purpose is None or r["purpose"] == purpose)]
        return listed(found, after, limit, order == "desc", "after")

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        del self.records[file_id]
        for suffix in (".json", ".data"):
            self._data(file_id, suffix).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- the folder -------------------------------------------------------------------------------
    def _upload(self, file_id: str) -> int:
        received = self.uploads.get(file_id)
        if received is None:
            raise NotFound(f"file: no upload '{file_id[:256]}' under way", "file")
        return received

    def _data(self, file_id: str, suffix: str = ".data") -> Path:
        if not FILE_ID.match(file_id):
            raise NotFound(f"file_id: no file '{file_id[:256]}'", "file_id")
        return self.folder / f"{file_id}{suffix}"

    def _write(self, record: dict) -> None:
        write_whole(self._data(record["id"], ".json"), json.dumps(record))

    def _load(self) -> None:
        """The folder's finished files; uploads a stopped store left unfinished are removed."""
        for path in [*self.folder.glob("file-*.upload"), *self.folder.glob("file-*.part")]:
            path.unlink(missing_ok=True)
        found = []
        for path in self.folder.glob("file-*.json"):
            try:
                record = json.loads(path.read_text())
                if not self._data(record["id"]).is_file():
                    raise ValueError("its bytes are missing")
                found.append((record["created_at"], path.stat().st_mtime_ns, record))
            except (OSError, ValueError, KeyError) as e:
                logger.warning("file store: skipping %s (%s)", path, e)
        for *_, record in sorted(found, key=lambda f: f[:2]):  # in the order they were made
            self.records[record["id"]] = record


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def write_whole(path: Path, text: str) -> None:
    """`text` at `path`, whole or not at all (a `.part` beside it renamed into place)."""
    partial = path.with_suffix(".part")
    partial.write_text(text)
    os.replace(partial, path)


def listed(records: list[dict], after: str | None, limit: int, newest_first: bool, param: str) -> dict:
    """OpenAI's cursor page over records (each with an `id`) in the order they were made: oldest
    first, or newest first; those after the record `after` (400 naming `param` where it is none
    of them)."""
    ordered = records[::-1] if newest_first else list(records)
    if after is not None:
        ids = [r["id"] for r in ordered]
        if after not in ids:
            raise RequestError(f"{param}: '{after[:256]}' is not one of the listed ids", param)
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
