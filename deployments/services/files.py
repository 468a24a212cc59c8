"""The files of /v1/files: the batch inputs clients upload and the output and error files the
batches write, in a folder (deployments.app.Records holds one store, every ingress replica
reaches it by handle).

A file is two entries in the folder: its bytes (`file-ID.data`) and its record (`file-ID.json`,
OpenAI's file object), each written whole (a `.part` renamed into place), so a store that
restarts reads back every file that was finished and none that was not. An upload arrives in
pieces (`begin`, `append`, `finish`): the bytes travel between replicas a piece at a time, never
as one message of the whole file; the ingress stops an upload at the size limit. A read is a
snapshot (`open_read`): the file's bytes as they were when it began, whole though the file is
deleted or expires meanwhile. Each file expires as OpenAI's (`expires_at`: 30 days after it was
made unless its upload or batch said otherwise) and is then removed (`expire`).

The folder and what it holds are the server user's alone (0700, files 0600: `private_folder`,
`private_opener`): uploads and answers are no other local user's to read.
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
# OpenAI's retention: a file of purpose batch expires 30 days after it was made unless its upload
# says otherwise (`expires_after`: 1 hour to 30 days), a batch's output as its `output_expires_after` says.
EXPIRES_AFTER = (3600, 30 * 24 * 3600)  # (least, most and default) seconds
READ_IDLE_SECONDS = 600.0  # a read untouched this long is closed (its reader, an ingress replica, went away)


class FileStore:
    """Files by id in `folder` (see the module docstring). Records are plain dicts: OpenAI's file
    object (id, object, bytes, created_at, filename, purpose, status, expires_at)."""

    def __init__(self, folder: Path, clock=time.time):
        self.folder, self.clock = private_folder(folder), clock
        self.records: dict[str, dict] = {}
        self.uploads: dict[str, int] = {}  # file id -> bytes received, while its upload runs
        self.reads: dict[str, list] = {}  # read id -> [open file, monotonic time last read]
        self._load()

    # -- uploads ----------------------------------------------------------------------------------
    def begin(self, filename: str) -> str:
        """A new file, its pieces to come (`append`, then `finish`)."""
        file_id = new_file_id()
        self.records[file_id] = {"id": file_id, "object": "file", "bytes": 0, "created_at": int(self.clock()),
                                 "filename": filename, "purpose": "batch", "status": "uploaded",
                                 "expires_at": None, "status_details": None}
        self.uploads[file_id] = 0
        with open(self._data(file_id, ".upload"), "wb", opener=private_opener):
            pass
        return file_id

    def append(self, file_id: str, piece: bytes) -> None:
        received = self._upload(file_id) + len(piece)
        with open(self._data(file_id, ".upload"), "ab", opener=private_opener) as out:
            out.write(piece)
        self.uploads[file_id] = received

    def finish(self, file_id: str, purpose: str, expires_after: int | None = None) -> dict:
        """The upload whole: the file kept (its record returned), expiring `expires_after` seconds
        after it was made (None: EXPIRES_AFTER's most, OpenAI's default)."""
        received, record = self._upload(file_id), self.records[file_id]
        os.replace(self._data(file_id, ".upload"), self._data(file_id))
        del self.uploads[file_id]
        record.update(bytes=received, purpose=purpose, status="processed",
                      expires_at=record["created_at"] + (expires_after or EXPIRES_AFTER[1]))
        self._write(record)
        return record

    def abort(self, file_id: str) -> None:
        """An upload that will not finish (its client left, its ingress replica went away)."""
        if self.uploads.pop(file_id, None) is not None:
            self.records.pop(file_id, None)
            self._data(file_id, ".upload").unlink(missing_ok=True)

    def adopt(self, path: Path, file_id: str, filename: str, purpose: str, expires_after: int | None = None) -> dict:
        """A file written elsewhere in the folder's file system (a batch's output) kept under
        `file_id`, moved in whole; the record it already has where it was adopted before."""
        if file_id in self.records:
            return self.records[file_id]
        now = int(self.clock())
        record = {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": now,
                  "filename": filename, "purpose": purpose, "status": "processed",
                  "expires_at": now + (expires_after or EXPIRES_AFTER[1]), "status_details": None}
        os.replace(path, self._data(file_id))
        self.records[file_id] = record
        self._write(record)
        return record

    # -- reading ----------------------------------------------------------------------------------
    def get(self, file_id: str, param: str = "file_id") -> dict:
        """The record of a finished file; NotFound naming `param` for any other id."""
        record = self.records.get(file_id)
        if record is None or file_id in self.uploads:
            raise NotFound(f"{param}: no file '{file_id[:256]}' (unknown, deleted or expired)", param)
        return record

    def path(self, file_id: str) -> Path:
        self.get(file_id)
        return self._data(file_id)

    def open_read(self, file_id: str) -> tuple[str, int]:
        """A read of the file as it is now: (its id for `read`, its bytes). The file stays open
        until `close_read` (or READ_IDLE_SECONDS without a read), so a DELETE meanwhile cannot
        pull its bytes away (an unlinked file lives on while it is open)."""
        now = time.monotonic()
        for stale in [r for r, (_, used) in self.reads.items() if now - used > READ_IDLE_SECONDS]:
            self.close_read(stale)
        data = self.path(file_id).open("rb")
        read_id = secrets.token_hex(12)
        self.reads[read_id] = [data, now]
        return read_id, os.fstat(data.fileno()).st_size

    def read(self, read_id: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of an open read from `offset` (b"" past its end)."""
        opened = self.reads.get(read_id)
        if opened is None:
            raise NotFound(f"file: no read '{read_id[:64]}' open (closed after {READ_IDLE_SECONDS:.0f} s idle)",
                           "file_id")
        opened[1] = time.monotonic()
        return os.pread(opened[0].fileno(), size, offset)

    def close_read(self, read_id: str) -> None:
        opened = self.reads.pop(read_id, None)
        if opened is not None:
            opened[0].close()

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

    def expire(self, now: float, keep=frozenset()) -> list[str]:
        """Every finished file whose `expires_at` has come, removed (but those in `keep`: the
        inputs of batches still running); their ids."""
        gone = [r["id"] for r in self.records.values() if r["id"] not in self.uploads and r["id"] not in keep
                and r.get("expires_at") is not None and r["expires_at"] <= now]
        for file_id in gone:
            self.delete(file_id)
        return gone

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
            if record.get("expires_at") is None:  # kept by a server before files expired
                record["expires_at"] = record["created_at"] + EXPIRES_AFTER[1]
            self.records[record["id"]] = record


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def private_folder(path: Path) -> Path:
    """`path` as a folder only its owner may enter (0700, made so where it exists already): what
    a server keeps (uploads, answers, stored conversations) is no other local user's to read."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_opener(path, flags: int) -> int:
    """open()'s opener for a file only its owner may read (0600 where it is made)."""
    return os.open(path, flags, 0o600)


def write_whole(path: Path, text: str) -> None:
    """`text` at `path` (0600), whole or not at all (a `.part` beside it renamed into place)."""
    partial = path.with_suffix(".part")
    partial.unlink(missing_ok=True)  # made again 0600, whatever a stopped writer left
    with open(partial, "w", opener=private_opener) as out:
        out.write(text)
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
