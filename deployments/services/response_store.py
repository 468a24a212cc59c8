"""The stored responses of /v1/responses: what `previous_response_id`, GET, DELETE, input_items
and cancel read, shared by every ingress replica (deployments.app.Responses holds one store).

A stored response is a record: the response object as the client got it, its input items, the
conversation it ends (the chat messages a next turn continues, instructions left out, as OpenAI
carries them), the decoder replica that ran it (the next turn goes there: its prefix cache holds
the conversation) and, for a background response, whether a client asked to cancel it.

Bounded in bytes (the least recently used go first), each record kept for `ttl_seconds` after it
was last written, and optionally persisted to a folder (a file per response, written whole, read
back when the store starts), so a restarted store replica keeps the conversations.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger("ray.serve")
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")  # what may name a file in the folder
RUNNING = ("queued", "in_progress")


class ResponseStore:
    """Records by response id (see the module docstring); every method takes and gives plain
    dicts, so the store travels behind a Serve handle unchanged."""

    def __init__(self, max_bytes: int, ttl_seconds: float, folder: str | None = None, clock=time.time):
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl_seconds, clock
        self.folder = Path(folder) if folder else None
        self.records: OrderedDict[str, tuple[float, int, dict]] = OrderedDict()  # id -> (written, bytes, record)
        self.bytes = 0
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    def put(self, record: dict) -> None:
        """Keep (or replace) a record; the least recently used go while the store holds more
        than its bytes. A record larger than the whole store is not kept."""
        key = record["response"]["id"]
        text = json.dumps(record, separators=(",", ":"))
        self._forget(key, keep_file=True)
        if len(text) > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than the response store (%d bytes): not stored",
                           key, len(text), self.max_bytes)
            self._remove_file(key)
            return
        self.records[key] = (self.clock(), len(text), record)
        self.bytes += len(text)
        self._write(key, text)
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self.records)))

    def get(self, key: str) -> dict | None:
        """The record, or None: unknown, deleted, expired or evicted."""
        found = self.records.get(key)
        if found is None:
            return None
        if self.clock() - found[0] > self.ttl:
            self._forget(key)
            return None
        self.records.move_to_end(key)
        return found[2]

    def delete(self, key: str) -> bool:
        if self.get(key) is None:
            return False
        self._forget(key)
        return True

    def cancel(self, key: str) -> dict | None:
        """Mark a running background response cancelled (its runner stops it when it next
        looks); the record as it is now, or None when there is none."""
        record = self.get(key)
        if record is not None and record["response"].get("status") in RUNNING:
            record["cancel"] = True
        return record

    def cancelled(self, key: str) -> bool:
        """Whether the response's runner should stop: a client cancelled it, or it is gone."""
        record = self.get(key)
        return record is None or bool(record.get("cancel"))

    def stats(self) -> dict:
        return {"responses": len(self.records), "bytes": self.bytes, "max_bytes": self.max_bytes}

    # -- the folder ------------------------------------------------------------------------
    def _forget(self, key: str, keep_file: bool = False) -> None:
        found = self.records.pop(key, None)
        if found is not None:
            self.bytes -= found[1]
        if not keep_file:
            self._remove_file(key)

    def _path(self, key: str) -> Path | None:
        return None if self.folder is None or not RESPONSE_ID.match(key) else self.folder / f"{key}.json"

    def _write(self, key: str, text: str) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            partial = path.with_suffix(".part")
            partial.write_text(text)
            os.replace(partial, path)  # whole or not at all
        except OSError as e:
            logger.warning("response store: could not write %s (%s); it is kept in memory only", path, e)

    def _remove_file(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def _load(self) -> None:
        """The folder's records, oldest first, those expired or unreadable removed."""
        found = []
        for path in self.folder.glob("resp_*.json"):
            try:
                written = path.stat().st_mtime
                if self.clock() - written > self.ttl:
                    path.unlink(missing_ok=True)
                    continue
                text = path.read_text()
                found.append((written, text, json.loads(text)))
            except (OSError, ValueError) as e:
                logger.warning("response store: skipping %s (%s)", path, e)
        for written, text, record in sorted(found, key=lambda f: f[0]):
            key = record["response"]["id"]
            if record["response"].get("status") in RUNNING:  # its runner went with the last store's ingress
                record["response"].update(status="failed", error={
                    "code": "server_error", "message": "the server restarted while this background response ran"})
            self.records[key] = (written, len(text), record)
            self.bytes += len(text)
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self.records)))
