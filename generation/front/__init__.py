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
    encoders.py        the encoders a server runs beside the decoder (EncoderFront: audio, texts, images, videos)
    models.py          what a model folder is, asked before anything loads (ModelFolder: kind, embedding, folder)
    embeddings.py      an embedding model behind the door (EmbeddingFront: inputs checked, vectors out)
    errors.py          Refused (a request's field as data), Overloaded, and the table from an
                       engine setting to the request's field

    front = EngineFront.from_model("folder", EngineOptions(slots=8))
    async for event in front.stream(EngineRequest(messages=[{"role": "user", "content": "Hi"}])):
        ...
"""

from generation.engine.batching import QueueFull, Request
from generation.engine.budget import FIXED_SLOTS
from generation.logits.constraints import GrammarBudget
from generation.logits.prompt_logprobs import from_lists as prompt_logprobs_from_lists
from generation.params import limits
from generation.runtime import cores
from generation.text.tool_calls import ToolError, check_tools

from .embeddings import EmbeddingFront
from .encoders import EncoderFront
from .errors import Overloaded, Refused
from .models import ModelFolder
from .front import Delta, Echo, EngineFront, Finish, Generation, rejected
from .options import EngineOptions
from .reasoning import CHOICES as REASONING_PARSERS
from .request import EngineRequest
from .speech import SpeechRequest, transcribe

# The front's own names, and beside them what a server needs of the engine's edges: the limits its
# request shapes state, a constraint's budget, a tool's schema check, where its processes compute
# (`cores`), and the batching loop's contract a test's fake batcher keeps (Request, QueueFull), and
# the slots `slots=0` gives where no budget decides (FIXED_SLOTS: the fake's, decoder autoscaling's).
__all__ = [
    "Delta", "Echo", "EmbeddingFront", "EncoderFront", "EngineFront", "EngineOptions", "EngineRequest", "Finish", "Generation",
    "Overloaded", "REASONING_PARSERS", "Refused", "ModelFolder", "SpeechRequest", "rejected", "transcribe",
    "GrammarBudget", "QueueFull", "Request", "ToolError", "check_tools", "cores",
    "limits", "prompt_logprobs_from_lists", "FIXED_SLOTS",
]
