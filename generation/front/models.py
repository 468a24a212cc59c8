"""What a model folder (or hub repository) is, asked before anything loads, so a server says
what is wrong with it before it starts anything."""

from __future__ import annotations


class ModelFolder:
    """A model's source (folder or hub id) as a server asks about it before loading it."""

    @staticmethod
    def kind(source) -> str:
        """text, encoder-decoder or vision: what a model folder or hub repository is (its family's KIND)."""
        from generation import families

        return families.kind(source)

    @staticmethod
    def embeds(source, variant: str | None = None) -> bool:
        """Whether `source` is an embedding model (its graph gives last_hidden_state)."""
        from generation.core.embed import is_embedding_folder
        from generation.runtime.model import resolve_folder

        return is_embedding_folder(resolve_folder(source, variant))

    @staticmethod
    def precision(source, options) -> str:
        """The precision `source`'s decoder would load at on this machine as `options` (EngineOptions:
        precision, provider, variant) ask, and why, in words (runtime.precision.choose: a replica
        on another node decides on its own CPU)."""
        from generation.runtime.model import decoder_files, planned_precision, resolve_folder

        folder = resolve_folder(source, options.variant)
        decoder, config, _ = decoder_files(folder, options.variant)
        choice = planned_precision(decoder, config, options.precision, options.provider)
        return f"{choice.name} ({options.precision} asked): {choice.reason}"

    @staticmethod
    def local(source, variant: str | None = None):
        """The local folder of a model folder or hub id (downloaded once), once it holds what
        loading it reads first (config.json, the decoder file for `variant`): ModelError with
        load's words where it does not."""
        from generation.runtime.model import decoder_files, resolve_folder

        folder = resolve_folder(source, variant)
        decoder_files(folder, variant)
        return folder
