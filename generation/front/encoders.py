"""The encoders a server runs beside the decoder: audio, source texts, images and videos in,
encoder outputs or features out, refusals naming the field (Refused).

An encoder-decoder model's encoder and a vision-language model's vision encoder run where a
server wants them (in their own replicas, scaled apart from the decoder); what they return goes
to `EngineFront.stream` as its `encoder` or `images`. `cache_by`: a (lookup, store) pair of
callbacks over the caller's cache by content, as the engine's cached encoders take it.
"""

from __future__ import annotations

from .errors import Refused
from .loading import load_model
from .options import EngineOptions


class EncoderFront:
    """A model's encoder (an encoder-decoder's, or a vision-language model's vision encoder)
    behind the front's door, as a server's encoder replica holds it."""

    def __init__(self, model):
        self.model = model

    @classmethod
    def from_model(cls, source, kind: str, options: EngineOptions | None = None) -> "EncoderFront":
        """The model of `source`, which must be of `kind` ("encoder-decoder" or "vision"), loaded
        as `options` say (EngineOptions: its variant, provider, threads)."""
        from generation import families

        model = load_model(source, options or EngineOptions())
        if families.family(model).KIND != kind:
            if kind == "vision":
                raise ValueError(f"{source} has no vision encoder (onnx/vision_encoder.onnx): it is a {model.family} "
                                 "model")
            raise ValueError(f"{source} has no encoder: it is a {model.family} model, not an encoder-decoder")
        return cls(model)

    @property
    def family(self) -> str:
        return self.model.family

    @staticmethod
    def decode_audio(data: bytes, filename: str = "file"):
        """An uploaded file's samples (mono, 16 kHz)."""
        from generation.families.whisper.audio import load_audio

        if not data:
            raise Refused(f"'{filename}' is empty", "file")
        try:
            return load_audio(bytes(data))
        except ValueError as e:
            raise Refused(f"'{filename}' could not be read as audio: {e}", "file") from None

    def encode_audio(self, windows, cache_by):
        """Whisper's encoder over log-mel windows [n, n_mels, frames]: (EncoderOutputs, rows computed)."""
        from generation.runtime.encoders import encode_audio_cached

        return encode_audio_cached(self.model, windows, *cache_by)

    def encode_texts(self, sources: list, cache_by):
        """A text encoder over texts or token id lists: (EncoderOutputs, rows computed); a source
        longer than the encoder's positions is refused, naming the prompt."""
        import generation
        from generation.families.seq2seq import encode_sources_cached

        try:
            return encode_sources_cached(generation.context(self.model), sources, *cache_by)
        except ValueError as e:
            raise Refused(str(e), "prompt") from None

    def encode_image(self, data: bytes, name: str = "image"):
        """An image file's features, preprocessed as the model's transformers processor does."""
        from generation.families.images import load_image
        from generation.families.vl_prompts import encode_image as encoded, preprocess

        try:
            images = preprocess(self.model, [load_image(bytes(data), name)])
        except ValueError as e:
            raise Refused(f"not an image this server reads: {e}", name) from None
        return encoded(self.model, images)

    @property
    def takes_videos(self) -> bool:
        from generation.families.videos import takes_videos as takes

        return takes(self.model)

    def encode_video(self, data: bytes | list[bytes], name: str = "video"):
        """A video's features: a video file (every frame, PyAV) or its frames' image files; a video
        of more tokens than the model's context is refused before the encoder runs."""
        from generation.families.videos import video_frames
        from generation.families.vl_prompts import encode_video as encoded, preprocess

        frames = isinstance(data, (list, tuple))
        try:
            videos = preprocess(self.model, [], [video_frames([bytes(d) for d in data] if frames else bytes(data),
                                                              name)])
        except ValueError as e:
            raise Refused(str(e), name, message=str(e) if str(e).startswith(name) else f"{name}: {e}") from None
        context = self.model.max_context
        if context and videos.video_features > context:
            raise Refused(f"the video makes {videos.video_features} video tokens; the model's context holds "
                          f"{context}", name)
        return encoded(self.model, videos)
