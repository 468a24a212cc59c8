"""The stored responses of /v1/responses: what `previous_response_id`, GET, DELETE, input_items
and cancel read, shared by every ingress replica (the Records deployment holds one store).

A stored response is a record: the response object as the client got it, its input items, the
conversation it ends (the chat messages a next turn continues, instructions left out, as OpenAI
carries them), the decoder replica that ran it (the next turn goes there: its prefix cache holds
the conversation) and, for a background response, whether a client asked to cancel it, the
heartbeat of the ingress replica that runs it and, when it was also streamed, its events (a
client that lost the stream resumes it from any replica: GET ?stream=true&starting_after=N).

A background response's owner (the ingress replica running it) writes it queued, in progress
(`update`), then beats every few seconds (`beat`: its heartbeat, its new events; the answer says
whether to go on), then writes its end (`update`). A running record whose heartbeat is older than
`stale_seconds` is failed for every reader alike (GET, previous_response_id, cancel, a restarted
store reading its folder): its owner stopped. `update` writes only over a record that is there
and still running, so a response deleted while it ran stays deleted.

Bounded in bytes (the least recently used go first; a streamed response's events count), each
record kept for `ttl_seconds` after it was last written, and optionally persisted to a folder
(0700, a file 0600 per response, written whole: files.private_folder, write_whole; read back
when the store starts; a beat stays in memory), so a restarted store replica keeps the conversations.

Serve runs a replica's sync methods on its thread pool, several at once: every method takes the
store's lock (an OrderedDict read by one thread while another evicts raises).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .files import private_folder, write_whole

logger = logging.getLogger("ray.serve")
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")  # what may name a file in the folder
RUNNING = ("queued", "in_progress")
STALE_SECONDS = 10.0  # a running record's owner beats every BEAT_SECONDS (http/response_runs.py), far more often
STOPPED = "the server running this background response stopped"


@dataclass
class _Entry:
    written: float  # its TTL counts from here
    size: int  # bytes, as JSON
    record: dict


class ResponseStore:
    """Records by response id (see the module docstring); every method takes and gives plain
    dicts, so the store travels behind a Serve handle unchanged."""

    def __init__(self, max_bytes: int, ttl_seconds: float, folder: str | None = None, clock=time.time,
                 stale_seconds: float = STALE_SECONDS):
        self.max_bytes, self.ttl, self.stale, self.clock = max_bytes, ttl_seconds, stale_seconds, clock
        self.folder = Path(folder) if folder else None
        self.records: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()
        if self.folder is not None:
            private_folder(self.folder)
            self._load()

    def put(self, record: dict) -> None:
        """Keep (or replace) a record; the least recently used go while the store holds more
        than its bytes. A record larger than the whole store is not kept."""
        with self.lock:
            self._keep(self._beaten(record))

    def update(self, record: dict) -> bool:
        """A running record's progress or end, from its owner: written only over one that is
        there and still running (not deleted, expired, evicted, nor failed for its stopped
        heartbeat), keeping a client's cancel. Whether it was written."""
        with self.lock:
            found = self._live(record["response"]["id"])
            if found is None or found["response"].get("status") not in RUNNING:
                return False
            if found.get("cancel"):
                record = {**record, "cancel": True}
            return self._keep(self._beaten(record))

    def beat(self, key: str, first: int, events: list[str]) -> dict:
        """A running record's owner alive: its heartbeat now, and its stream's events numbered
        `first` on kept (none where the store holds fewer than `first`: restarted from its folder,
        it has those of the last write; `kept` tells the owner where to send from). `run`: on,
        cancel (a client asked), or stop (the record is gone or no longer running)."""
        with self.lock:
            record = self._live(key)
            if record is None or record["response"].get("status") not in RUNNING:
                return {"run": "stop", "kept": 0}
            entry, held = self.records[key], record.get("events")
            record["heartbeat"] = entry.written = self.clock()
            if held is not None and first <= len(held):
                added = events[len(held) - first:]
                held.extend(added)
                grown = sum(len(json.dumps(e)) + 1 for e in added)
                entry.size += grown
                self.bytes += grown
                self._evict()
                if key not in self.records:
                    return {"run": "stop", "kept": 0}
            return {"run": "cancel" if record.get("cancel") else "on", "kept": len(held) if held is not None else 0}

    def get(self, key: str) -> dict | None:
        """The record without its events, or None: unknown, deleted, expired or evicted."""
        with self.lock:
            return _without_events(self._live(key))

    def events_after(self, key: str, after: int) -> dict | None:
        """A streamed background response's events numbered after `after` (None where it kept
        none: not created with background and stream), its last event, and the response as it
        is now; None where the record is gone."""
        with self.lock:
            record = self._live(key)
            if record is None:
                return None
            held = record.get("events")
            return {"response": record["response"], "events": None if held is None else held[after + 1:],
                    "last": held[-1] if held else None}

    def delete(self, key: str) -> bool:
        with self.lock:
            if self._live(key) is None:
                return False
            self._forget(key)
            return True

    def cancel_response(self, key: str) -> dict | None:
        """Mark a running background response cancelled (its owner stops it at its next beat);
        the record as it is now (without its events), or None when there is none."""
        with self.lock:
            record = self._live(key)
            if record is not None and record["response"].get("status") in RUNNING:
                record["cancel"] = True
            return _without_events(record)

    def stats(self) -> dict:
        with self.lock:
            return {"responses": len(self.records), "bytes": self.bytes, "max_bytes": self.max_bytes}

    # -- under the lock --------------------------------------------------------------------
    def _beaten(self, record: dict) -> dict:
        """A running record as its owner writes it: its heartbeat now."""
        if record["response"].get("status") in RUNNING:
            record = {**record, "heartbeat": self.clock()}
        return record

    def _keep(self, record: dict) -> bool:
        key = record["response"]["id"]
        text = json.dumps(record, separators=(",", ":"))
        self._forget(key, keep_file=True)
        if len(text) > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than the response store (%d bytes): not stored",
                           key, len(text), self.max_bytes)
            self._remove_file(key)
            return False
        self.records[key] = _Entry(self.clock(), len(text), record)
        self.bytes += len(text)
        self._write(key, text)
        self._evict()
        return key in self.records

    def _live(self, key: str) -> dict | None:
        """The record, now the most recently used; None where unknown or expired (forgotten). A
        running one whose owner's heartbeat stopped is failed first."""
        entry = self.records.get(key)
        if entry is None:
            return None
        if self.clock() - entry.written > self.ttl:
            self._forget(key)
            return None
        self.records.move_to_end(key)
        self._fail_if_stopped(entry.record, entry.written)
        return self.records[key].record if key in self.records else None

    def _fail_if_stopped(self, record: dict, written: float) -> None:
        response = record["response"]
        silent = self.clock() - record.get("heartbeat", written)
        if response.get("status") in RUNNING and silent > self.stale:
            response.update(status="failed", completed_at=self.clock(), error={
                "code": "server_error", "message": f"{STOPPED} (no heartbeat for {silent:.0f} seconds)"})
            record.pop("cancel", None)
            self._keep(record)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            self._forget(next(iter(self.records)))

    def _forget(self, key: str, keep_file: bool = False) -> None:
        entry = self.records.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        if not keep_file:
            self._remove_file(key)

    # -- the folder ------------------------------------------------------------------------
    def _path(self, key: str) -> Path | None:
        return None if self.folder is None or not RESPONSE_ID.match(key) else self.folder / f"{key}.json"

    def _write(self, key: str, text: str) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            write_whole(path, text)
        except OSError as e:
            logger.warning("response store: could not write %s (%s); it is kept in memory only", path, e)

    def _remove_file(self, key: str) -> None:
        path = self._path(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def _load(self) -> None:
        """The folder's records, oldest first, those expired or unreadable removed, a running
        one whose owner's heartbeat stopped failed."""
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
            self.records[record["response"]["id"]] = _Entry(written, len(text), record)
            self.bytes += len(text)
        self._evict()
        for entry in list(self.records.values()):
            self._fail_if_stopped(entry.record, entry.written)


def _without_events(record: dict | None) -> dict | None:
    """A record as GET, cancel and a next turn read it: its events stay in the store."""
    return None if record is None else {k: v for k, v in record.items() if k != "events"}
