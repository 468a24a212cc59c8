"""Model families: one place decides what a model folder is (`detect`, run by `load`: a model's
`family`), and each family is a module of this package with one contract, the `Family` protocol
of contract.py (KIND, detect, prepare, encode, HOOKS; its docstring tables what each family
answers):

    KIND                           what a server runs for it: "text" (a decoder), "encoder-decoder"
                                   (an encoder deployment beside the decoder) or "vision" (a vision
                                   encoder deployment beside it)
    detect(config, files) -> bool  whether a folder is of the family: its config.json, its file
                                   names (relative, "/"-separated)
    prepare(ctx, inputs, ...)      a request's inputs into a Prepared: the decoder's prompts and
                                   what `generate(encoder=...)` takes
    encode(model, inputs)          the family's encoder over what its preprocessing gives
    HOOKS                          what the family adds to the engine's layers below it
                                   (generation.runtime.hooks.Hooks), put on the Model by `load`

    whisper    Whisper: audio in (whisper/: audio, timestamps, long-form windows)
    vit_gpt2   vision-encoder-decoder captioners (a ViT encoder, a GPT-2 decoder)
    seq2seq    encoder-decoder text models (Marian, T5, BART)
    idefics3   Idefics3 / SmolVLM (a vision encoder beside the decoder, frames)
    qwen2_vl   Qwen2-VL (a vision encoder beside the decoder, M-RoPE positions)
    text       decoder-only text models (Llama, Qwen2, GPT-2, ...; onnxruntime-genai folders)

The vision-language families share vision.py (features in inputs_embeds, and the prompt-image
hooks every decoder-only family gives), images.py and vl_prompts.py (prompts from parts or
chats), each family module giving its own preprocessing, encoder and positions. This module
imports none of them until asked.

`load` is `generation.load`: the layers below the families load a folder without asking what it
is (`runtime.model.load`); here the model then gets its family and that family's hooks.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..runtime.model import Model
from ..runtime.model import load as load_folder

# Detection order: the first family whose detect() claims a folder is its family.
FAMILIES = ("whisper", "vit_gpt2", "seq2seq", "idefics3", "qwen2_vl", "text")
KINDS = ("text", "encoder-decoder", "vision")


@dataclass
class Prepared:
    """A request ready to decode: one decoder prompt per row, and the encoder's outputs (an
    encoder-decoder's EncoderOutputs, a vision-language model's PromptImages, None)."""

    prompts: list[list[int]]
    encoder: object


def module(name: str):
    """The module of family `name`."""
    if name not in FAMILIES:
        raise ValueError(f"no model family {name!r}: the families are {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{name}")


def detect(config: dict, files) -> str:
    """The family of a folder with this config.json (empty for an onnxruntime-genai build without
    one) and these file names."""
    files = [str(f) for f in files]
    return next(name for name in FAMILIES if module(name).detect(config, files))


def load(source, *, variant: str | None = None, provider: str | None = None, threads: int | None = None,
         spin_wait: bool = True, fuse: bool = True, precision: str | None = None, cuda_graphs: bool = False,
         lora=None) -> Model:
    """`generation.load`: the decoder of `source` (a folder or a hub id) loaded as
    `runtime.model.load` does (its options), with its family (`model.family`, by `detect`) and
    that family's hooks (`model.hooks`, the module's HOOKS) on it."""
    model = load_folder(source, variant=variant, provider=provider, threads=threads, spin_wait=spin_wait, fuse=fuse,
                        precision=precision, cuda_graphs=cuda_graphs, lora=lora)
    model.family = detect(model.config, folder_files(model.folder))
    model.hooks = module(model.family).HOOKS
    model.loader = load
    return model


def family(model):
    """The module of a loaded model's family."""
    return module(model.family)


def folder_files(folder: Path) -> list[str]:
    """A folder's file names as detect reads them: the top level and onnx/."""
    return sorted(p.relative_to(folder).as_posix() for pattern in ("*", "onnx/*") for p in folder.glob(pattern)
                  if p.is_file())


def source_family(source) -> str:
    """The family of a model folder or hub repository, without loading it (for a hub id,
    config.json alone is fetched and the repository's file names listed)."""
    path = Path(source)
    if path.is_dir():
        config = path / "config.json"
        return detect(json.loads(config.read_text()) if config.is_file() else {}, folder_files(path))
    from huggingface_hub import hf_hub_download, list_repo_files

    config = json.loads(Path(hf_hub_download(str(source), "config.json")).read_text())
    return detect(config, list_repo_files(str(source)))


def kind(source) -> str:
    """What a server runs for a model folder or hub id: its family's KIND."""
    return module(source_family(source)).KIND


def has_vision_encoder(files) -> bool:
    """Whether the files hold a vision encoder beside the decoder (onnx/vision_encoder*.onnx)."""
    return any(Path(f).name.startswith("vision_encoder") and f.endswith(".onnx") for f in files)
