"""The Files and Batches API's state and its runner: the files of /v1/files (files.py) and the
batches of /v1/batches, each a file of requests run line by line through the server's own routes
at a priority below interactive requests, its answers written to an output file (the 200s) and an
error file (the rest), as OpenAI's Batch API.

One BatchService (in the Records deployment's one replica, deployments.app.Records) holds every file
and batch; every ingress replica reaches it by handle. It runs the lines itself: `send` posts a
line to the routes of whichever ingress (or Server) replica Serve picks and answers its output
line, or None where no replica could take it (lost while it ran the line, restarting, or busy: a
503), and the line is sent again after a pause. So killing or redeploying the ingress costs a batch
only the lines in flight there, sent again. Each batch keeps at most `concurrency` lines in flight
(all batches together), each at GenerateRequest.priority PRIORITY: the scheduler seats interactive
requests (priority 0) first.

In its folder a batch's record and its answers so far are on disk: a runner that restarts resumes
every batch that had not ended, skipping the lines whose custom_id is already answered (a line cut
short by the stop dropped first: batch/requests.answered_ids). Statuses, as OpenAI's: validating
(the input file read and checked: JSON lines, a custom_id each, unique, POST to the batch's
endpoint; any problem fails the batch with its `errors`), in_progress, finalizing (the output and
error files made), completed; failed; cancelling, then cancelled (the answers so far in its files).
`completed` says every line was answered, not that every answer was a 200: a batch whose every
line failed (a server error each) is completed with request_counts.failed == total, no output file
and an error file, as OpenAI reports one (its `failed` is a batch whose input failed validation).
The input file is read a line at a time, twice (validating keeps only the custom_ids; the runner
reads a block of lines ahead of its workers), never held whole.

An ended batch's record is kept BATCH_RETENTION_SECONDS after it was made, as its files are (OpenAI's
30 days: services/files.py), and at most MAX_ENDED_BATCHES of them (the oldest go first): a server
that runs batch after batch keeps a bounded number of records.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import json
import logging
import re
import secrets
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path

from ..batch.requests import BatchRequest, answered_ids, answered_ok, output_line, parsed_line
from ..errors import NotFound, RequestError
from .files import EXPIRES_AFTER, FileStore, listed, private_folder, private_opener, write_whole

logger = logging.getLogger("ray.serve")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")  # a batch's routes
PRIORITY = 1  # a batch line's GenerateRequest.priority: after every interactive request (0)
PRIORITIZED = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # the routes that take `priority`
MAX_LINES = 50_000  # requests in one batch (OpenAI's limit)
MAX_ERRORS = 100  # validation errors a failed batch lists
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_RETENTION_SECONDS = EXPIRES_AFTER[1]  # an ended batch's record, after it was made (its files' default)
MAX_ENDED_BATCHES = 10_000  # ended batch records kept (~2 KB each)
SWEEP_SECONDS = 60  # expired files and batch records are looked for at most this often
BLOCK_LINES = 256  # the input lines the runner reads ahead of its workers
# A line no replica could take is sent again after a pause that doubles up to RETRY_PAUSE[1] s, for
# up to LINE_RETRY_SECONDS; then its last answer (503) is its error line.
RETRY_PAUSE, LINE_RETRY_SECONDS = (0.5, 10.0), 600.0
BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")


class BatchService:
    """Files and batches in `folder` (None: a temporary folder, made when first needed and
    removed by close()); lines through `send(custom_id, url, body) -> output line | None`, at most
    `concurrency` at once. Every method takes and gives plain data, so the service travels behind
    a Serve handle unchanged; refusals are RequestError / NotFound naming the field."""

    def __init__(self, folder: str | None, concurrency: int, send, clock=time.time):
        self.send, self.concurrency, self.clock = send, concurrency, clock
        self.slots = asyncio.Semaphore(concurrency)
        self.runs: dict[str, asyncio.Task] = {}
        self.workers: dict[str, list[asyncio.Task]] = {}  # a running batch's line workers (cancel stops them)
        self.temporary, self.root, self._files = folder is None, None, None
        self.batches: dict[str, dict] = {}
        self._swept = clock()
        if folder is not None:
            self._open(Path(folder))
            self.batches = self._load()

    @property
    def files(self) -> FileStore:
        """The folder's files; a temporary folder is made when first needed (an application whose
        Files and Batches API is never called makes none)."""
        if self._files is None:
            self._open(Path(tempfile.mkdtemp(prefix="raymuter-batches-")))
        return self._files

    def _open(self, root: Path) -> None:
        self.root = private_folder(root)
        self._files = FileStore(root / "files", self.clock)
        self.folder = private_folder(root / "batches")

    def start(self) -> None:
        """Run every batch that had not ended (a restarted runner's); on the running event loop."""
        for batch in self.batches.values():
            if batch["status"] in UNFINISHED:
                self._launch(batch)

    def close(self) -> None:
        for task in list(self.runs.values()):
            task.cancel()
        if self._files is not None:
            for read_id in list(self._files.reads):
                self._files.close_read(read_id)
        if self.temporary and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- files (routes/files.py) -----------------------------------------------------------------
    async def begin_file(self, filename: str) -> str:
        self._sweep()
        return self.files.begin(filename)

    async def append_file(self, file_id: str, piece: bytes) -> None:
        self.files.append(file_id, piece)

    async def finish_file(self, file_id: str, purpose: str, expires_after: int | None = None) -> dict:
        return dict(self.files.finish(file_id, purpose, expires_after))

    async def abort_file(self, file_id: str) -> None:
        self.files.abort(file_id)

    async def file(self, file_id: str) -> dict:
        self._sweep()
        return dict(self.files.get(file_id))

    async def open_file(self, file_id: str) -> dict:
        """A read of the file's bytes as they are now (FileStore.open_read): its `read` id and
        its `bytes`, read by `file_piece` and ended by `close_file`."""
        self._sweep()
        read_id, size = self.files.open_read(file_id)
        return {"read": read_id, "bytes": size}

    async def file_piece(self, read_id: str, offset: int, size: int) -> bytes:
        return self.files.read(read_id, offset, size)

    async def close_file(self, read_id: str) -> None:
        self.files.close_read(read_id)

    async def file_page(self, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        self._sweep()
        return copy.deepcopy(self.files.page(purpose, after, limit, order))

    async def delete_file(self, file_id: str) -> dict:
        for batch in self.batches.values():
            if batch["input_file_id"] == file_id and batch["status"] in UNFINISHED:
                raise RequestError(f"file_id: '{file_id}' is the input of batch {batch['id']}, which is "
                                   f"{batch['status']}; cancel it first", "file_id")
        return self.files.delete(file_id)

    # -- batches (routes/batches.py) -------------------------------------------------------------
    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict | None = None, output_expires_after: int | None = None) -> dict:
        """A batch of the file's requests to `endpoint`, validating at once (see the module
        docstring); its output and error files expire `output_expires_after` seconds after they
        are made (None: the files' default)."""
        self._sweep()
        source = self.files.get(input_file_id, "input_file_id")
        if source["purpose"] != "batch":
            raise RequestError(f"input_file_id: '{input_file_id}' has purpose '{source['purpose']}'; a batch reads "
                               "a file uploaded with purpose 'batch'", "input_file_id")
        now = int(self.clock())
        batch = {"id": f"batch_{secrets.token_hex(16)}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": None, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "_output_expires_after": output_expires_after}
        self.batches[batch["id"]] = batch
        self._save(batch)
        self._launch(batch)
        return public(batch)

    async def batch(self, batch_id: str) -> dict:
        self._sweep()
        return public(self._batch(batch_id))

    async def page(self, after: str | None, limit: int) -> dict:
        """OpenAI's list of batches: the newest first, after the batch `after`, at most `limit`."""
        self._sweep()
        found = listed(list(self.batches.values()), after, limit, True, "after")
        return {**found, "data": [public(b) for b in found["data"]]}

    async def cancel_batch(self, batch_id: str) -> dict:
        """Stop a validating or running batch: cancelling (the lines in flight stopped, their
        rows freed), then cancelled with the answers so far in its files."""
        batch = self._batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            self._set(batch, "cancelling")
            for worker in self.workers.get(batch_id, ()):
                worker.cancel()
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise RequestError(f"batch_id: '{batch_id}' is {batch['status']}; only a validating or in_progress "
                               "batch can be cancelled", "batch_id")
        return public(batch)

    # -- the runner ------------------------------------------------------------------------------
    def _launch(self, batch: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self.runs[batch["id"]] = task
        task.add_done_callback(lambda _: self.runs.pop(batch["id"], None))

    async def _run(self, batch: dict) -> None:
        try:
            if batch["status"] in ("validating", "in_progress"):  # read again when resumed
                path = self.files.path(batch["input_file_id"])
                total, errors = await asyncio.to_thread(checked_lines, path, batch["endpoint"])
                if batch["status"] == "validating" and errors:
                    self._set(batch, "failed", errors={"object": "list", "data": errors[:MAX_ERRORS]})
                    return
                if batch["status"] == "validating":  # not cancelled meanwhile
                    batch["request_counts"]["total"] = total
                    self._set(batch, "in_progress")
                if batch["status"] == "in_progress":
                    await self._answer_all(batch, path)
            await self._finish(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the batch fails, the runner goes on with the others
            logger.exception("batch %s failed", batch["id"])
            message = str(e) if isinstance(e, RequestError) else f"the server failed on this batch ({type(e).__name__})"
            self._set(batch, "failed", errors={"object": "list", "data": [
                {"code": "server_error", "message": message, "param": getattr(e, "field", None), "line": None}]})

    async def _answer_all(self, batch: dict, path: Path) -> None:
        """Every line of the input file at `path` not answered yet, each answer appended to the
        output or the error file."""
        output, error = self._answers(batch, "output"), self._answers(batch, "error")
        done_ok, done_failed = answered_ids(output), answered_ids(error)
        counts = batch["request_counts"]
        counts.update(completed=len(done_ok), failed=len(done_failed))
        with (Pending(path, done_ok | done_failed) as pending, open(output, "a", opener=private_opener) as ok,
              open(error, "a", opener=private_opener) as failed):
            async def worker():
                while (request := await pending.next()) is not None:  # shared: each worker takes the next line
                    async with self.slots:
                        line = await self._answered(request)
                    good = answered_ok(line)
                    out = ok if good else failed
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                    counts["completed" if good else "failed"] += 1

            workers = [asyncio.ensure_future(worker()) for _ in range(self.concurrency)]
            self.workers[batch["id"]] = workers
            try:
                results = await asyncio.gather(*workers, return_exceptions=True)
            finally:
                self.workers.pop(batch["id"], None)
        raised = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if raised:
            raise raised[0]

    async def _answered(self, request: BatchRequest) -> dict:
        """The line's output line; sent again while no replica could take it (see the module docstring)."""
        body = prioritized(request)
        deadline, pause = time.monotonic() + LINE_RETRY_SECONDS, RETRY_PAUSE[0]
        while True:
            try:
                line = await self.send(request.custom_id, request.url, body)
            except Exception as e:  # noqa: BLE001 - the server's fault, not the line's: said in its error line
                logger.error("batch line %s: %r", request.custom_id, e)
                return output_line(request.custom_id, error=f"the server failed on this line ({type(e).__name__})",
                                   code="server_error")
            busy = line is None or (line["response"] or {}).get("status_code") == 503
            if not busy:
                return line
            if time.monotonic() > deadline:
                return line or output_line(request.custom_id, code="server_error", error=(
                    f"no replica of the server's routes took this line for {LINE_RETRY_SECONDS:.0f} s"))
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_PAUSE[1])

    async def _finish(self, batch: dict) -> None:
        """The answers as the batch's output and error files, then completed (or cancelled)."""
        cancelled = batch["status"] == "cancelling"
        if not cancelled and batch["status"] != "finalizing":
            self._set(batch, "finalizing")
        for kind in ("output", "error"):
            answers, file_id = self._answers(batch, kind), answers_file_id(batch["id"], kind)
            if file_id not in self.files.records and answers.is_file() and answers.stat().st_size:
                self.files.adopt(answers, file_id, f"{batch['id']}_{kind}.jsonl", "batch_output",
                                 batch.get("_output_expires_after"))
            answers.unlink(missing_ok=True)  # moved into the files, or empty: no file of the batch's
            if file_id in self.files.records:
                batch[f"{kind}_file_id"] = file_id
        self._set(batch, "cancelled" if cancelled else "completed")

    # -- records ---------------------------------------------------------------------------------
    def _batch(self, batch_id: str) -> dict:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"batch_id: no batch '{batch_id[:256]}'", "batch_id")
        return batch

    def _set(self, batch: dict, status: str, **fields) -> None:
        """The batch's new status (its time stamped, as OpenAI's `<status>_at`), kept on disk."""
        batch.update(status=status, **fields)
        batch[f"{status}_at"] = int(self.clock())
        self._save(batch)

    def _save(self, batch: dict) -> None:
        write_whole(self.folder / f"{batch['id']}.json", json.dumps(batch))

    def _answers(self, batch: dict, kind: str) -> Path:
        return self.folder / f"{batch['id']}.{kind}.jsonl"

    def _sweep(self) -> None:
        """The files whose `expires_at` has come and the ended batches past their retention or
        beyond MAX_ENDED_BATCHES (the oldest first), removed; at most every SWEEP_SECONDS."""
        now = self.clock()
        if now - self._swept < SWEEP_SECONDS or self._files is None:
            return
        self._swept = now
        running = {b["input_file_id"] for b in self.batches.values() if b["status"] in UNFINISHED}
        self.files.expire(now, keep=running)
        ended = [b for b in self.batches.values() if b["status"] not in UNFINISHED]  # oldest first
        past = len(ended) - MAX_ENDED_BATCHES
        for k, batch in enumerate(ended):
            if k < past or batch["created_at"] + BATCH_RETENTION_SECONDS <= now:
                del self.batches[batch["id"]]
                (self.folder / f"{batch['id']}.json").unlink(missing_ok=True)

    def _load(self) -> dict[str, dict]:
        found = []
        for path in self.folder.glob("batch_*.json"):
            try:
                batch = json.loads(path.read_text())
                if not BATCH_ID.match(batch["id"]):
                    raise ValueError(f"not a batch id: {batch['id']!r}")
            except (OSError, ValueError, KeyError) as e:
                logger.warning("batches: skipping %s (%s)", path, e)
                continue
            found.append(batch)
        return {b["id"]: b for b in sorted(found, key=lambda b: (b["created_at"], b["id"]))}


def checked_lines(path: Path, endpoint: str) -> tuple[int, list[dict]]:
    """The number of requests in the input file, and OpenAI's batch errors for the lines that are
    none (each with its line number and the field at fault): a line that is not a request
    (batch/requests.parsed_line), a url other than the batch's endpoint, a custom_id an earlier line
    has; blank lines are skipped. Read a line at a time: only the custom_ids are kept."""
    count, errors, seen = 0, [], set()

    def problem(message: str, param: str | None, number: int | None, code: str = "invalid_request"):
        errors.append({"code": code, "message": message, "param": param, "line": number})

    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                problem(f"line {number} is not UTF-8", None, number, "invalid_json_line")
                continue
            if not text.strip():
                continue
            request = parsed_line(text)
            if request.error is not None:
                problem(request.error, request.param, number,
                        "invalid_request" if request.param else "invalid_json_line")
            elif request.url != endpoint:
                problem(f"url: {request.url} is not this batch's endpoint {endpoint}", "url", number)
            elif request.custom_id in seen:
                problem(f"custom_id: '{request.custom_id[:128]}' is an earlier line's too; each line's is its own",
                        "custom_id", number, "duplicate_custom_id")
            else:
                seen.add(request.custom_id)
                count += 1
    if not count and not errors:
        problem("input_file_id: the file holds no request", "input_file_id", None)
    if count > MAX_LINES:
        problem(f"input_file_id: the file holds {count} requests; a batch takes at most {MAX_LINES}",
                "input_file_id", None)
    return count, errors


def requests_in(path: Path):
    """The requests of an input file checked_lines found no fault in, a line at a time."""
    with path.open("rb") as lines:
        for raw in lines:
            text = raw.decode("utf-8")
            if text.strip():
                yield parsed_line(text)


class Pending:
    """A batch's requests not answered yet (their custom_ids not in `answered`), for workers that
    each take the next: read from the input file BLOCK_LINES at a time on a worker thread, so the
    event loop never parses a block and the file is never held whole (a 200 MiB file is several
    times that as Python objects). A context manager: its exit closes the file."""

    def __init__(self, path: Path, answered: set[str]):
        self.source = requests_in(path)
        self.lines = (r for r in self.source if r.custom_id not in answered)
        self.block: deque[BatchRequest] = deque()
        self.lock, self.done = asyncio.Lock(), False

    async def next(self) -> BatchRequest | None:
        async with self.lock:  # one reader of the file at a time
            if not self.block and not self.done:
                self.block.extend(await asyncio.to_thread(list, itertools.islice(self.lines, BLOCK_LINES)))
                self.done = not self.block
            return self.block.popleft() if self.block else None

    def __enter__(self) -> "Pending":
        return self

    def __exit__(self, *_) -> None:
        try:
            self.source.close()
        except ValueError:  # a block is being read on its thread (the batch was cancelled): closed when collected
            pass


def public(batch: dict) -> dict:
    """A copy of a batch record as OpenAI's batch object (without the runner's own fields, `_...`)."""
    return copy.deepcopy({k: v for k, v in batch.items() if not k.startswith("_")})


def prioritized(request: BatchRequest) -> dict:
    """The line's body at the batch priority (a line that asks a later one keeps it; a value that
    is no integer is left for its route to refuse by name, as it would refuse it sent directly)."""
    body, given = dict(request.body), request.body.get("priority")
    if request.url in PRIORITIZED and (given is None or type(given) is int and given < PRIORITY):
        body["priority"] = PRIORITY
    return body


def answers_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same whenever it is made (a runner that stops
    while it finalizes makes it again under the id it had)."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]
