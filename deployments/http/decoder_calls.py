"""The ingress's calls of the decoder (and, for a request's sources, images and videos, of the
Encoder and Vision deployments), and what a failed call means to the client.

A decoder answer that refused the request becomes the ApiError it names (`refused`); a failed
call becomes one too (`api_error_of`): 400 naming the field for the request's own fault, 503 with
Retry-After when the decoder's queue is full or its replica is gone, 500 with only a request id
(the details in the log) for anything else. A request whose decoder replica is lost before it
answered is sent again, to another replica (Serve's router drops the lost one within a moment):
at most RETRIES times, after a pause; once a streamed chunk has gone out, the loss ends the
stream with its error (the request may have been half done).
"""

from __future__ import annotations

import asyncio

from ..errors import Overloaded, RequestError
from generation.front import Finish, Generation

from ..schema import EmbedRequest, EmbedResponse, GenerateRequest
from .edge import RETRY_AFTER_SECONDS, request_id, server_error
from .media import Media
from .openai import ApiError
from .to_decoder import for_request

RETRIES, RETRY_SECONDS = 2, 0.5


def busy(reason) -> ApiError:
    return ApiError(503, f"the server is busy ({reason}); retry after {RETRY_AFTER_SECONDS} s",
                    kind="server_overloaded")


def refused(result, request_id_: str) -> ApiError | None:
    """The ApiError of a decoder answer that refused or failed the request (its Finish says so:
    the answer itself, a stream's event or a Generation's), else None. The one place a decoder's
    refusal becomes OpenAI's error."""
    finish = result.finish if isinstance(result, Generation) else result
    if isinstance(finish, Finish) and finish.finish_reason == "rejected":
        return busy(finish.error) if finish.status == 503 else ApiError(finish.status or 400, finish.error,
                                                                        param=finish.field, predicate=finish.predicate)
    if isinstance(finish, Finish) and finish.finish_reason == "error":
        if finish.status == 503:  # its engine went away (a new one is starting): the client may retry
            return busy(finish.error)
        if finish.status and finish.status < 500:  # the batch refused it while admitting it: its own fault
            return ApiError(finish.status, finish.error, param=finish.field, predicate=finish.predicate)
        return server_error(request_id_, "the generation failed in the batch", finish.error)
    return None


def replica_lost(error: BaseException) -> bool:
    """The call failed because its replica (or its node) went away, not because of the request."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(error, (RayActorError, ActorUnavailableError, DeploymentUnavailableError))


def cause_of(error: BaseException) -> BaseException:
    """What a failed call raised in its replica (Ray wraps it in a RayTaskError, once per hop: an
    encoder's failure reaches us through the decoder call that took its reply)."""
    from ray.exceptions import RayTaskError

    cause = error
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    return cause


def api_error_of(error: BaseException, request_id_: str) -> ApiError:
    """What a failed decoder call means to the client."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    cause = cause_of(error)
    if isinstance(cause, ApiError):
        return cause
    if isinstance(cause, RequestError):
        return ApiError(cause.status, str(cause), param=cause.field)
    if isinstance(cause, (Overloaded, BackPressureError)):
        return busy(cause)
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return ApiError(503, f"the decoder replica serving this request failed ({type(cause).__name__}); "
                             "retry: a new replica takes over", kind="server_error")
    return server_error(request_id_, "the decoder call failed", cause)


class DecoderCalls:
    """The decoder by handle (a DeploymentHandle, or the colocated server's LocalHandle), with the
    Encoder and Vision deployments that prepare a request's sources and images (None where the
    model has none); every failure comes out as an ApiError."""

    def __init__(self, decoder, encoder, vision, media: Media):
        self.decoder, self.encoder, self.vision, self.media = decoder, encoder, vision, media
        self._decoder_stream = decoder.options(stream=True)

    async def chunks(self, request: GenerateRequest, body=None, prompt_index: int | None = None):
        """The decoder's stream, its failures as ApiErrors (naming the OpenAI request's field
        where `body` is one). A request whose replica is lost before its first chunk (it was
        queued there, or its node went away) moves to another replica (RETRIES times); once a
        chunk has gone out, the loss ends the stream with its error."""
        images = await self.media.vision_replies(request, self.vision)
        for attempt in range(RETRIES + 1):
            stream = self._for(request, True).stream.remote(request, self.encoded(request), *images)
            sent = False
            try:
                while True:
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    refusal = refused(chunk, request.request_id)
                    if refusal is not None:
                        raise refusal
                    sent = True
                    yield chunk
            except ApiError as e:
                raise e if body is None else for_request(e, body, prompt_index) from None
            except Exception as e:  # noqa: BLE001
                if sent or attempt == RETRIES or not replica_lost(e):
                    raise api_error_of(e, request.request_id) from None
                await asyncio.sleep(RETRY_SECONDS * (attempt + 1))  # Serve drops the lost replica meanwhile
            finally:
                stream.cancel()

    def _for(self, request: GenerateRequest, stream: bool = False):
        """The decoder's handle for `request`: one naming a LoRA adapter goes to the replicas that
        hold it where any does (Serve's model multiplexing; deployments.replicas.held_adapters)."""
        adapter = request.settings.get("adapter")
        if adapter is None:
            return self._decoder_stream if stream else self.decoder
        return self.decoder.options(stream=stream, multiplexed_model_id=str(adapter))

    async def generate(self, request: GenerateRequest) -> Generation:
        """The whole generation; a replica lost before it answered: moved to another (RETRIES times)."""
        images = await self.media.vision_replies(request, self.vision)
        for attempt in range(RETRIES + 1):
            try:
                result = await self.call(self._for(request).generate.remote(request, self.encoded(request), *images),
                                         request.request_id, raw=attempt < RETRIES)
                break
            except Exception as e:  # noqa: BLE001 - only a lost replica comes back raw
                if not replica_lost(e):
                    raise api_error_of(e, request.request_id) from None
                await asyncio.sleep(RETRY_SECONDS * (attempt + 1))
        refusal = refused(result, request.request_id)
        if refusal is not None:
            raise refusal
        return result

    async def choice(self, request: GenerateRequest, body, prompt_index: int | None):
        """One choice of an OpenAI request's generation; a refusal names the request's field."""
        try:
            return await self.generate(request)
        except ApiError as e:
            raise for_request(e, body, prompt_index) from None

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        """Embeddings of texts or token ids."""
        return await self.answer(self.decoder.embed.remote(request), request.request_id or request_id("embd-"))

    async def tokenize(self, prompt, messages, add_special_tokens, add_generation_prompt, variables, token_strs,
                       request_id_: str):
        """Token ids (and their strings) of a text or of chat messages rendered by the template."""
        return await self.answer(self.decoder.tokenize.remote(prompt, messages, add_special_tokens,
                                                              add_generation_prompt, variables, token_strs), request_id_)

    async def detokenize(self, ids: list[int], request_id_: str) -> str:
        return await self.answer(self.decoder.detokenize.remote(ids), request_id_)

    async def load_adapter(self, name: str, path: str, request_id_: str) -> None:
        """A LoRA adapter known to the decoder from now on (its refusal: the ApiError naming lora_name or lora_path)."""
        await self.answer(self.decoder.load_adapter.remote(name, path), request_id_)

    async def unload_adapter(self, name: str, request_id_: str) -> None:
        await self.answer(self.decoder.unload_adapter.remote(name), request_id_)

    async def metrics(self, timeout: float = 5.0) -> list[str]:
        """The decoder's metrics and the encoder's or vision encoder's where the application has
        one, each in Prometheus' text format; a part that does not answer in `timeout` seconds
        is a comment saying so (the ingress's own still come back)."""
        parts = []
        for name, handle in (("decoder", self.decoder), ("encoder", self.encoder), ("vision", self.vision)):
            if handle is None:
                continue
            try:
                parts.append(await asyncio.wait_for(handle.metrics.remote(), timeout=timeout))
            except Exception as e:  # noqa: BLE001 - the other parts still come back
                parts.append(f"# {name} metrics unavailable: {type(e).__name__}\n")
        return parts

    async def answer(self, response, request_id_: str):
        """A decoder call's reply (embed, tokenize, detokenize, transcribe), a refusal raised as its ApiError."""
        out = await self.call(response, request_id_)
        refusal = refused(out, request_id_)
        if refusal is not None:
            raise refusal
        return out

    async def call(self, response, request_id_: str, raw: bool = False):
        """The decoder call's reply, its failure as an ApiError (`raw`: a lost replica's failure as
        it came, for the caller to retry)."""
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()  # the decoder stops the request and frees its slot
            raise
        except Exception as e:  # noqa: BLE001
            if raw and replica_lost(e):
                raise
            raise api_error_of(e, request_id_) from None

    def encoded(self, request: GenerateRequest):
        """An encoder-decoder model's source through the Encoder deployment (a reply the
        decoder opens), or None for a decoder-only model."""
        if self.encoder is None:
            return None
        if request.messages is not None:
            raise ApiError(400, "messages: this encoder-decoder model takes a prompt (the source text), not chat",
                           param="messages")
        return self.encoder.encode_text.remote([request.prompt])
