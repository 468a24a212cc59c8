"""The application's arguments (AppConfig: `serve run deployments.app:build key=value ...`, `args:` in a
Serve config, `raymuter serve`'s flags) and what they name: the model id clients send, the kind of
model the application is built for.
"""

import os
from dataclasses import fields
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from generation.front import FIXED_SLOTS, EngineOptions

from .autoscaling import Autoscaling


DEFAULT_MODEL_NAME = "raymuter-default"  # the model id of the default model (no `model` given)


class ServingConfig(BaseModel):
    """The application's own arguments; AppConfig adds the engine's (EngineOptions' fields)."""

    model_config = ConfigDict(extra="forbid")

    @property
    def options(self) -> EngineOptions:
        """The engine's options these arguments give."""
        values = {name: getattr(self, name) for name in ENGINE_OPTIONS}
        if values["engine_cores"] is not None:
            values["engine_cores"] = tuple(values["engine_cores"])
        return EngineOptions(**values)

    @model_validator(mode="after")
    def _options_go_together(self):
        self.options  # noqa: B018 - EngineOptions refuses, by name, what does not go together (cores, process)
        if self.records == "server" and (not self.colocate or "decoder" in self.autoscaling):
            raise ValueError("records: 'server' keeps the records in the colocated Server's one replica; it needs "
                             "colocate and no autoscaling of the decoder (else 'deployment')")
        decoder = self.autoscaling.get("decoder")
        if self.slots == 0 and decoder is not None and decoder.policy == "occupancy":
            self.slots = FIXED_SLOTS  # occupancy counts rows against slots: a replica's share, not the budget's
        return self

    model: str | None = None  # folder or hub id; None: the default model that ships with Raymuter
    name: str | None = None  # the model id clients send; default: the folder's name
    engine: str = Field(default="onnx", pattern="^(onnx|fake)$")  # fake: tests of the serving layer
    settings: dict[str, Any] = Field(default_factory=dict)  # defaults for every request
    api_key: str | None = None  # a bearer token every route but /health requires; or RAYMUTER_API_KEY
    allow_remote_images: bool = False  # fetch http(s) image URLs of chat messages (data URLs always work)
    max_body_bytes: int = Field(default=25 * 2**20, ge=1024)
    stream_interval_ms: float = Field(default=10.0, ge=0, le=1000)  # a stream's chunks at most this often
    # (the first at once; the tokens made meanwhile travel together: fewer messages through Ray
    # when a fast model streams to many clients; stretched while many rows run, about 200 chunks a
    # second in all, at most one every 100 ms: generator.CHUNKS_PER_SECOND; 0: a chunk per token)
    # about this many chunks a second from all of a replica's streams together while many rows run
    # (docs/performance.md "Stream pacing": the measured trade of fewer chunks against later tokens)
    stream_chunks_per_second: float = Field(default=200.0, gt=0, le=100_000)
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
    # Where the stored responses and the Files and Batches API's records live: "deployment", the
    # Records deployment every ingress replica shares; "server", inside the colocated Server's
    # replica (one Ray worker process fewer: ~0.5% of a core idle and its memory; `raymuter serve`'s
    # default with one Server replica). "server" needs colocate and no decoder autoscaling: a second
    # Server replica would hold records of its own.
    records: Literal["deployment", "server"] = "deployment"
    # /v1/responses' stored responses (the Records deployment, one replica every ingress replica
    # shares): at most these bytes (the least recently used go first), each kept this many seconds
    # after it was last written, and persisted to this folder when given (made 0700, its files 0600; a
    # restarted store keeps them)
    response_store_bytes: int = Field(default=256 * 2**20, ge=2**20, le=2**40)
    response_ttl_seconds: float = Field(default=24 * 3600, gt=0, le=366 * 24 * 3600)
    response_folder: str | None = None
    # /v1/files and /v1/batches (the Records deployment, one replica every ingress replica shares): the
    # files and batches are kept in this folder, made 0700 (a restarted Records replica resumes the batches
    # that ran; default: a temporary folder of the replica's, gone with it; `raymuter serve` gives a folder
    # in its run folder, gone at stop); an upload takes at most
    # file_size_limit bytes; the batches keep at most batch_concurrency lines in flight (default:
    # slots), each at a priority below every interactive request
    batch_folder: str | None = None
    file_size_limit: int = Field(default=200 * 2**20, ge=1, le=2**40)
    batch_concurrency: int | None = Field(default=None, ge=1, le=4096)


# An engine option's type where the dataclass's says less than a Serve config's JSON (and the
# Helm chart's schema) should.
JSON_TYPES = {
    "draft": str | None,
    "engine_cores": list[Annotated[int, Field(ge=0)]] | None,
    "grammar_budget": dict[str, int | float],
    "lora_modules": dict[str, str],
}


def _engine_field(option, hint):
    """An engine option as a pydantic field: its served default, range or choices, and help."""
    meta = option.metadata
    kind = JSON_TYPES.get(option.name, hint)
    if meta["choices"] is not None:
        kind = Literal[meta["choices"]] if option.default is not None else Literal[meta["choices"]] | None
    bounds = {} if meta["low"] is None else {"ge": meta["low"], "le": meta["high"]}
    if isinstance(meta["served"], dict):
        return kind, Field(default_factory=dict, description=meta["help"])
    if option.name == "engine_cores":
        bounds["min_length"] = 1
    return kind, Field(default=meta["served"], description=meta["help"], **bounds)


_HINTS = get_type_hints(EngineOptions)
ENGINE_OPTIONS = [f.name for f in fields(EngineOptions) if f.metadata["serve"]]
AppConfig = create_model(
    "AppConfig", __base__=ServingConfig, __module__=__name__,
    __doc__="""The application's arguments (`serve run deployments.app:build key=value ...`, or `args:`
    in cluster/serve.yaml): its own (ServingConfig) and the engine's, made from EngineOptions'
    fields (their help, ranges and a server's defaults), flat as a Serve config writes them; `options`
    gives the EngineOptions. Resources and autoscaling of each deployment are Serve's own options,
    set in the config file's `deployments:` list.""",
    **{f.name: _engine_field(f, _HINTS[f.name]) for f in fields(EngineOptions) if f.metadata["serve"]})


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
