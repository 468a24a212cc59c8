"""A batch line sent to the server's own routes in this process: the application's ASGI app called
through httpx, so a line's answer is what the server answers the same request over HTTP (the
route's validation, its errors naming the body's field, the same engine path and seeds).

`raymuter batch`'s engine actors (worker.py) call the app over their own decoder; the server's
ingress (deployments.app.Ingress.answer_line) calls its own routes for the Records deployment's
runner (deployments/services/batches.py).
"""

from __future__ import annotations

import json
import mimetypes
from pathlib import Path

from .requests import AUDIO, BatchRequest, output_line


class RouteClient:
    """`app`'s routes by in-process HTTP, each request with `headers` (the server's API key);
    `local_files`: an audio line's `body.file` is a path this process reads (`raymuter batch`
    only: a server never opens a path a client names)."""

    def __init__(self, app, headers: dict | None = None, local_files: bool = False):
        self.app, self.headers, self.local_files = app, headers or {}, local_files
        self._client = None

    async def answer(self, request: BatchRequest) -> dict:
        """The output line of a request that can be sent (its route's answer, whatever its status)."""
        import httpx

        if self._client is None:  # on the loop the lines run on
            self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://batch",
                                             headers=self.headers, timeout=None)
        try:
            if request.url in AUDIO:
                answer = await self._audio(request)
            else:
                answer = await self._client.post(request.url, json=request.body)
        except (OSError, ValueError) as e:
            return output_line(request.custom_id, error=f"{request.url}: {e}"[:500])
        try:
            body = answer.json()
        except ValueError:
            body = answer.text
        request_id = answer.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
        return output_line(request.custom_id, answer.status_code, body, request_id)

    async def _audio(self, request: BatchRequest):
        """A transcription or translation: the body's `file` is a path this process reads."""
        if not self.local_files:
            raise ValueError("an audio line's file is a path the offline batch reads; the server takes none")
        fields = dict(request.body)
        path = fields.pop("file", None)
        if not isinstance(path, str):
            raise ValueError("body.file: the audio file's path (a batch sends the file it names)")
        data = Path(path).read_bytes()
        kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
        form = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
        return await self._client.post(request.url, data=form, files={"file": (Path(path).name, data, kind)})
