"""The application's arguments (AppConfig: `serve run deployments.app:build key=value ...`, `args:` in a
Serve config, `raymuter serve`'s flags) and what they name: the model id clients send, the kind of
model the application is built for.
"""

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from generation.front import REASONING_PARSERS

from .autoscaling import Autoscaling


DEFAULT_MODEL_NAME = "raymuter-default"  # the model id of the default model (no `model` given)


class AppConfig(BaseModel):
    """The application's arguments (`serve run deployments.app:build key=value ...`, or `args:`
    in cluster/serve.yaml). Resources and autoscaling of each deployment are Serve's own
    options, set in the config file's `deployments:` list."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # folder or hub id; None: the default model that ships with Raymuter
    name: str | None = None  # the model id clients send; default: the folder's name
    engine: str = Field(default="onnx", pattern="^(onnx|fake)$")  # fake: tests of the serving layer
    # rows the decoder steps together at most; as many run as the KV budget (kv_cache_bytes) holds
    slots: int = Field(default=32, ge=1, le=1024)
    capacity: int | None = Field(default=None, ge=2)  # tokens per slot (default: the model's context, <= 4096)
    max_waiting: int = Field(default=256, ge=0)  # decoder queue; beyond it, 503
    # prompt prefixes kept per decoder replica (KV rows, bytes; 0: off): a prompt that starts as one
    # seen before runs only its rest (generation/cache/prefix.py)
    prefix_cache_bytes: int = Field(default=256 * 2**20, ge=0, le=2**40)
    # the KV cache's budget per decoder replica (bytes; default a quarter of the machine's memory,
    # 0: none): rows are seated while what they hold fits it, up to `slots` (generation/engine/budget.py)
    kv_cache_bytes: int | None = Field(default=None, ge=0, le=2**46)
    # the prompt tokens the decoder runs per step (None: generation.engine.batching's default; 0: every
    # prompt whole at once): a long prompt runs in chunks between the running rows' steps
    prefill_chunk_tokens: int | None = Field(default=None, ge=0, le=2**31)
    max_logprobs: int = Field(default=20, ge=-1, le=20)  # -1: no log-probabilities (the lean greedy loop)
    threads: int | None = Field(default=None, ge=1)  # onnxruntime intra-op threads per decoder replica
    spin: bool = True  # the decoder's idle onnxruntime threads spin between runs (False: they sleep)
    provider: str | None = None  # cuda, cpu; default: CUDA where the replica has a GPU
    variant: str | None = None
    fuse: bool = True  # run an Optimum / transformers.js Llama-family decoder as its fused rewrite (generation.load)
    # a draft model (folder or hub id) with the model's tokenizer: every step verifies its
    # proposals (num_assistant_tokens, num_assistant_tokens_schedule in settings); text models
    draft: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # defaults for every request
    api_key: str | None = None  # a bearer token every route but /health requires; or RAYMUTER_API_KEY
    allow_remote_images: bool = False  # fetch http(s) image URLs of chat messages (data URLs always work)
    max_body_bytes: int = Field(default=25 * 2**20, ge=1024)
    stream_interval_ms: float = Field(default=10.0, ge=0, le=1000)  # a stream's chunks at most this often
    # (the first at once; the tokens made meanwhile travel together: fewer messages through Ray
    # when a fast model streams to many clients; stretched while many rows run, about 200 chunks a
    # second in all, at most one every 100 ms: generator.CHUNKS_PER_SECOND; 0: a chunk per token)
    step_seconds: float = Field(default=0.005, gt=0)  # fake engine only: a step's cost, plus
    step_seconds_per_row: float = Field(default=0.0, ge=0)  # this for each row in it (bench/fleet.py)
    gpu: str = Field(default="auto", pattern="^(auto|yes|no)$")  # the decoder asks for num_gpus=1
    # Which deployments the application has (PARTS); auto: from the model folder. A Serve config
    # that names deployments (the Helm chart's) sets it, and a model of another kind is refused.
    kind: str = Field(default="auto", pattern="^(auto|text|encoder-decoder|vision)$")
    # Each deployment's autoscaling (deployments/autoscaling.py), by part: ingress, decoder,
    # encoder, vision; a part not named keeps one replica (or what a Serve config gives it).
    # The decoder scales on its rows and waiting requests against its slots (policy occupancy).
    autoscaling: dict[Literal["ingress", "decoder", "encoder", "vision"], Autoscaling] = Field(default_factory=dict)
    # The HTTP routes in the decoder's replica (deployments.app.Server): no Ray message per request
    # and streamed chunk between an ingress and the decoder; the routes then scale with the decoder
    # (its autoscaling, one proxy spreading requests) and the prefix router does not apply.
    colocate: bool = False
    # The decoder's batching loop in a child process of its replica (services/engine_process.py):
    # the routes' event loop and the engine's host Python then hold no GIL in common
    # (decoder-only text models; the weights are in the child's memory only).
    engine_process: bool = False
    # Where that child computes (generation/runtime/cores.py): on engine_cores, or on all but the first
    # reserve_cores of the replica's cores (None: 1 from 4 cores, 0 below), its onnxruntime threads
    # one a core unless `threads` says; the replica keeps the other cores. `raymuter serve` resolves
    # it on its machine and moves Ray's processes onto the kept cores as well.
    engine_cores: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    reserve_cores: int | None = Field(default=None, ge=0, le=4096)
    # What one request's constraint (structured outputs, tool_choice's grammar, each tool's parameters)
    # may cost, by field of generation.logits.constraints.GrammarBudget (seconds to compile it, and
    # llguidance's limits: max_grammar_size, initial_lexer_fuel, ...); a field not given keeps its default
    grammar_budget: dict[str, int | float] = Field(default_factory=dict)
    # How a chat's reasoning is told from its answer (generation/front/reasoning.py): auto (from the
    # chat template: the thinking markers it writes), none (all answer), or a parser by name
    reasoning_parser: str = Field(default="auto", pattern="^(" + "|".join(REASONING_PARSERS) + ")$")
    # /v1/responses' stored responses (the Responses deployment, one replica every ingress replica
    # shares): at most these bytes (the least recently used go first), each kept this many seconds
    # after it was last written, and persisted to this folder when given (made 0700, its files 0600; a
    # restarted store keeps them)
    response_store_bytes: int = Field(default=256 * 2**20, ge=2**20, le=2**40)
    response_ttl_seconds: float = Field(default=24 * 3600, gt=0, le=366 * 24 * 3600)
    response_folder: str | None = None
    # /v1/files and /v1/batches (the Batches deployment, one replica every ingress replica shares): the
    # files and batches are kept in this folder, made 0700 (a restarted Batches replica resumes the batches
    # that ran; default: a temporary folder of the replica's, gone with it; `raymuter serve` gives a folder
    # in its run folder, gone at stop); an upload takes at most
    # file_size_limit bytes; the batches keep at most batch_concurrency lines in flight (default:
    # slots), each at a priority below every interactive request
    batch_folder: str | None = None
    file_size_limit: int = Field(default=200 * 2**20, ge=1, le=2**40)
    batch_concurrency: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _cores_need_the_engine_process(self):
        if not self.engine_process and (self.engine_cores is not None or self.reserve_cores is not None):
            raise ValueError("engine_cores and reserve_cores place the batching loop's child process: they need "
                             "engine_process")
        if self.engine_cores is not None and self.reserve_cores is not None:
            raise ValueError("engine_cores and reserve_cores: give one (the replica keeps the cores engine_cores "
                             "does not name)")
        return self


def served_name(model: str | None, name: str | None = None) -> str:
    """The model id clients send: `name`, else the model folder's name (a hub id as given), else
    the default model's."""
    if name:
        return name
    if model is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def app_kind(cfg: AppConfig) -> str:
    """The PARTS the application has: the model's kind; a kind given in the config must be it."""
    found = model_kind(cfg)
    if cfg.kind not in ("auto", found):
        raise ValueError(f"kind: '{cfg.kind}' was given, but the model {cfg.model or '(default)'} is '{found}'")
    return found


def model_kind(cfg: AppConfig) -> str:
    """text, encoder-decoder or vision: what the model folder (or hub repository) is, as its
    family says (generation.families.kind); the fake engine and the default model: text."""
    if cfg.engine != "onnx" or cfg.model is None:
        return "text"
    from generation.front import ModelFolder

    return ModelFolder.kind(cfg.model)
