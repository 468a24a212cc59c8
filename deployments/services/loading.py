"""Each replica's service, loaded as the application's config (deployments.app.AppConfig) says:
the decoder's (the fake engine for tests of the serving layer, an embedding model's
EmbeddingService, or the TextGenerator over the model), the Encoder's and the Vision's. The
deployments in deployments/app.py hold what these return and call it."""

from __future__ import annotations


def decoder_service(cfg, default_name: str):
    """The service the Decoder deployment holds; `default_name`: the model id of the default model."""
    if cfg.engine == "fake":
        from ..fake import fake_generator

        name = cfg.name or (default_name if cfg.model is None else "fake")
        service = fake_generator(cfg.options, cfg.step_seconds, name, cfg.step_seconds_per_row)
        service.stream_interval = cfg.stream_interval_ms / 1000
        service.chunks_per_second = cfg.stream_chunks_per_second
        return service
    from generation.front import ModelFolder

    from .embeddings import EmbeddingService
    from .generator import TextGenerator

    model = cfg.model
    if model is None:
        from generation.default_model import default_model_path

        model = str(default_model_path())
    if ModelFolder.embeds(model, cfg.variant):
        return EmbeddingService.from_model(model, cfg.name, cfg.options)
    service = TextGenerator.from_model(model, name=cfg.name or (default_name if cfg.model is None else None),
                                       stream_interval=cfg.stream_interval_ms / 1000, options=cfg.options,
                                       **cfg.settings)
    service.chunks_per_second = cfg.stream_chunks_per_second
    return service


def encoding_service(kind: str, cfg):
    """The service of an Encoder ("encoder") or Vision ("vision") replica (services/encoding.py)."""
    if kind == "vision":
        from .vision import VisionService as service
    else:
        from .encoder import EncoderService as service
    return service(cfg.model, cfg.name, cfg.options)
