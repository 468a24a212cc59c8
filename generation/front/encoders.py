"""The encoders a server runs beside the decoder: audio, source texts, images and videos in,
encoder outputs or features out, refusals naming the field (Refused).

An encoder-decoder model's encoder and a vision-language model's vision encoder run where a
server wants them (in their own replicas, scaled apart from the decoder); what they return goes
to `EngineFront.stream` as its `encoder` or `images`. `cache_by`: a (lookup, store) pair of
callbacks over the caller's cache by content, as the engine's cached encoders take it.
"""

from __future__ import annotations

from .errors import Refused


def load_encoder(source, kind: str, variant: str | None = None, provider: str | None = None,
                 threads: int | None = None):
    """The model of `source`, which must be of `kind` ("encoder-decoder" or "vision")."""
    import generation
    from generation import families

    model = generation.load(source, variant=variant, provider=provider, threads=threads)
    if families.family(model).KIND != kind:
        if kind == "vision":
            raise ValueError(f"{source} has no vision encoder (onnx/vision_encoder.onnx): it is a {model.family} model")
        raise ValueError(f"{source} has no encoder: it is a {model.family} model, not an encoder-decoder")
    return model


def decode_audio(data: bytes, filename: str = "file"):
    """An uploaded file's samples (mono, 16 kHz)."""
    from generation.families.whisper.audio import load_audio

    if not data:
        raise Refused(f"'{filename}' is empty", "file")
    try:
        return load_audio(bytes(data))
    except ValueError as e:
        raise Refused(f"'{filename}' could not be read as audio: {e}", "file") from None


def encode_audio(model, windows, cache_by):
    """Whisper's encoder over log-mel windows [n, n_mels, frames]: (EncoderOutputs, rows computed)."""
    from generation.runtime.encoders import encode_audio_cached

    return encode_audio_cached(model, windows, *cache_by)


def encode_texts(model, sources: list, cache_by):
    """A text encoder over texts or token id lists: (EncoderOutputs, rows computed); a source
    longer than the encoder's positions is refused, naming the prompt."""
    import generation
    from generation.families.seq2seq import encode_sources_cached

    try:
        return encode_sources_cached(generation.context(model), sources, *cache_by)
    except ValueError as e:
        raise Refused(str(e), "prompt") from None


def encode_image(model, data: bytes, name: str = "image"):
    """An image file's features, preprocessed as the model's transformers processor does."""
    from generation.families.images import load_image
    from generation.families.vl_prompts import encode_image as encoded, preprocess

    try:
        images = preprocess(model, [load_image(bytes(data), name)])
    except ValueError as e:
        raise Refused(f"not an image this server reads: {e}", name) from None
    return encoded(model, images)


def takes_videos(model) -> bool:
    from generation.families.videos import takes_videos as takes

    return takes(model)


def encode_video(model, data: bytes | list[bytes], name: str = "video"):
    """A video's features: a video file (every frame, PyAV) or its frames' image files; a video
    of more tokens than the model's context is refused before the encoder runs."""
    from generation.families.videos import video_frames
    from generation.families.vl_prompts import encode_video as encoded, preprocess

    frames = isinstance(data, (list, tuple))
    try:
        videos = preprocess(model, [], [video_frames([bytes(d) for d in data] if frames else bytes(data), name)])
    except ValueError as e:
        raise Refused(str(e), name, message=str(e) if str(e).startswith(name) else f"{name}: {e}") from None
    context = model.max_context
    if context and videos.video_features > context:
        raise Refused(f"the video makes {videos.video_features} video tokens; the model's context holds {context}",
                      name)
    return encoded(model, videos)


def model_kind(source) -> str:
    """text, encoder-decoder or vision: what a model folder or hub repository is (its family's KIND)."""
    from generation import families

    return families.kind(source)


def is_embedding_model(source, variant: str | None = None) -> bool:
    """Whether `source` is an embedding model (its graph gives last_hidden_state)."""
    from generation.core.embed import is_embedding_folder
    from generation.runtime.model import resolve_folder

    return is_embedding_folder(resolve_folder(source, variant))


def model_folder(source, variant: str | None = None):
    """The local folder of a model folder or hub id (downloaded once), once it holds what loading
    it reads first (config.json, the decoder file for `variant`): ModelError with load's words
    where it does not (a server says so before it starts anything)."""
    from generation.runtime.model import decoder_files, resolve_folder

    folder = resolve_folder(source, variant)
    decoder_files(folder, variant)
    return folder
