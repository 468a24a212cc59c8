"""The engine front: the one door a server reaches the engine through.

As vLLM's engine splits input processing, the engine core and output processing, and
mlx-lm's server imports a handful of engine names: a request goes in (`EngineRequest`: messages
or a prompt, media features, tools, settings), events come out (`Echo`, `Delta`: text with stop
strings applied once, tokens and log-probabilities; `Finish`: tool calls, why it ended, counts;
`Generation`: them all as one answer). A server carries these shapes across its own process hops
as they are (deployments/: the Ray hop), adding none of its own.

    request.py         the front's request (EngineRequest)
    options.py         how the engine behind it runs (EngineOptions: slots, threads, ...)
    prompts.py         input processing: chat templates, tool grammars, eos ids, image prompts, checks
    loading.py         a batching loop (generation/engine/batching.py, or in a child process:
                       engine/process.py) over a model loaded from its folder
    output.py          output processing: detokenizing, stop strings held back and cut, tool calls
    reasoning.py       a thinking model's reasoning told apart from its answer (<think>...</think>)
    front.py           EngineFront: the door itself
    speech.py          Whisper's transcription through the front (the seek loop over windows)
    encoders.py        the encoders a server runs beside the decoder (audio, texts, images, videos)
    errors.py          Refused (a request's field as data), Overloaded, and the table from an
                       engine setting to the request's field

    front = EngineFront.from_model("folder", slots=8)
    async for event in front.stream(EngineRequest(messages=[{"role": "user", "content": "Hi"}])):
        ...
"""

from generation.core.embed import embed, load_embedder
from generation.logits.constraints import GrammarBudget
from generation.logits.prompt_logprobs import from_lists as prompt_logprobs_from_lists
from generation.params import limits
from generation.runtime.cores import parse as parse_cores, pin as pin_cores, placement as core_placement
from generation.text.tokenizer import model_tokenizer
from generation.text.tool_calls import ToolError, check_tools

from .encoders import (
    decode_audio,
    encode_audio,
    encode_image,
    encode_texts,
    encode_video,
    is_embedding_model,
    load_encoder,
    model_folder,
    model_kind,
    takes_videos,
)
from generation.engine.batching import DEFAULT_PREFILL_CHUNK_TOKENS, ContinuousBatcher, QueueFull, Request, Token
from .errors import Overloaded, Refused, request_field
from .front import Delta, Echo, EngineFront, Finish, Generation, detokenized, rejected
from .options import EngineOptions
from .output import TextDeltas
from .prompts import InputProcessor
from .reasoning import CHOICES as REASONING_PARSERS
from .request import EngineRequest
from .speech import SpeechRequest, transcribe

__all__ = [
    "DEFAULT_PREFILL_CHUNK_TOKENS", "ContinuousBatcher", "Delta", "Echo", "EngineFront", "EngineOptions", "EngineRequest", "Finish", "Generation", "GrammarBudget", "InputProcessor",
    "Overloaded", "QueueFull", "REASONING_PARSERS", "Refused", "Request", "SpeechRequest", "TextDeltas", "Token",
    "ToolError", "check_tools", "decode_audio", "detokenized", "embed", "encode_audio", "encode_image",
    "encode_texts", "encode_video", "is_embedding_model", "limits", "load_embedder", "load_encoder", "model_folder",
    "model_kind", "model_tokenizer", "prompt_logprobs_from_lists", "request_field", "rejected", "takes_videos",
    "transcribe", "core_placement", "parse_cores", "pin_cores",
]
