"""Text in and out: the model's tokenizer.json, and detokenizing a stream of token ids.

A byte-level BPE token can end in the middle of a UTF-8 character, so a streamed piece is only
released once it decodes without a replacement character, as TGI and vLLM do.
"""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path | None, folder: Path):
    """The `tokenizers.Tokenizer` of a model folder, or ValueError saying what is missing."""
    if path is None:
        raise ValueError(f"tokenizer.json is missing from {folder}; text in and out needs it "
                         "(token ids work without it)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on bad files
        raise ValueError(f"{path} is not a tokenizer the `tokenizers` library reads: {e}") from None


_TOKENIZERS: dict = {}


def model_tokenizer(model):
    """The tokenizer of a loaded model, read once per tokenizer file."""
    key = (model.tokenizer_path, model.folder)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(model.tokenizer_path, model.folder)
    return _TOKENIZERS[key]


class Detokenizer:
    """Turns the new token ids of one row, one at a time, into text pieces.

    >>> from tokenizers import Tokenizer, models
    >>> tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    >>> d = Detokenizer(tok)
    >>> [d.add(t) for t in (0, 1)]
    ['a', ' b']
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are already printed and not decoded again
        self.read_offset = 0  # ids before this are printed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        """The text that `token` completes ('' while a character is still incomplete)."""
        self.ids.append(int(token))
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream (an incomplete last character)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]

    def text(self) -> str:
        """All text so far."""
        return self._decode(self.ids)
