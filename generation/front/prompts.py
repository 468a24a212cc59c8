"""Input processing: an EngineRequest into the row the engine runs (prompt ids, settings, encoder).

Chat messages go through the model's chat template (tools given to it as transformers'
`apply_chat_template(tools=...)`), a vision-language chat's image and video parts become the
placed features of its images, a `tool_choice` other than "auto" becomes a grammar over the
template family's call format, `stop_token_ids` join the eos tokens the settings leave, and
what can be refused before the queue is refused here, naming the request's field (Refused).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Refused, refused, request_field
from .request import EngineRequest


@dataclass
class Row:
    """A request ready to queue: its prompt ids, its settings (over the server's), and its
    encoder outputs (an encoder-decoder's) or PromptImages (a vision-language chat's)."""

    prompt: list[int]
    settings: dict
    encoder: object = None


class InputProcessor:
    """A model's request processing. `model` and `ctx` are None for an engine without one (the
    serving layer's fake engine): chats then render with `template` alone."""

    def __init__(self, tokenizer, template: str | None, special_tokens: dict | None, context_length: int | None,
                 max_logprobs: int = 0, model=None, ctx=None, kind: str = "text"):
        self.tokenizer, self.template, self.special_tokens = tokenizer, template, special_tokens or {}
        self.context_length, self.max_logprobs = context_length, max_logprobs
        self.model, self.ctx, self.kind = model, ctx, kind
        self._longest_token: int | None = None

    @property
    def takes_images(self) -> bool:
        return self.kind == "vision"

    # -- prompts -------------------------------------------------------------------------------
    def prompt_ids(self, request: EngineRequest, images=()):
        """The prompt's token ids: ids as given, text tokenized, messages through the template.
        A vision-language chat: (ids, PromptImages) with `images` (its parts' features, in order)."""
        if request.messages is not None:
            return self._chat_ids(request, images)
        if isinstance(request.prompt, str):
            if not request.prompt:
                raise Refused("is empty", "prompt", message="prompt is empty")
            self.check_text_length(request.prompt, "prompt")
            return self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens).ids
        return list(request.prompt)

    def _chat_ids(self, request: EngineRequest, images):
        from generation.text.chat import ChatTemplateError
        from generation.text.tool_calls import ToolError, template_messages

        messages = [template_message(m, i, self.takes_images) for i, m in enumerate(request.messages)]
        try:
            messages = template_messages(messages)
        except ToolError as e:
            raise Refused(str(e), e.field, message=str(e)) from None
        variables = request.chat_template_kwargs
        if request.calls_tools:  # as transformers' apply_chat_template(tools=...)
            variables = {**(variables or {}), "tools": request.tools}
        try:
            if self.takes_images:
                return self._vision_chat(messages, list(images), request.add_generation_prompt, variables)
            text = self.render(messages, request.add_generation_prompt, variables)
        except ChatTemplateError as e:
            raise Refused(str(e), "messages", message=str(e)) from None
        self.check_text_length(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[dict], add_generation_prompt: bool, variables: dict | None) -> str:
        from generation.text.chat import render_chat

        return render_chat(self.template, messages, self.special_tokens, add_generation_prompt, variables)

    def _vision_chat(self, messages: list[dict], images: list, add_generation_prompt: bool, variables):
        """The chat's ids and PromptImages: the template rendered with image and video parts,
        each placeholder replaced by its image's expansion, as transformers'
        processor.apply_chat_template (generation.families.vl_prompts)."""
        from generation.families.vl_prompts import chat_ids, join_images, placed_images

        joined = join_images(images) if images else None
        try:
            ids = chat_ids(self.model, [messages], joined, add_generation_prompt, variables)[0]
        except ValueError as e:
            raise Refused(str(e), "messages") from None
        return ids, (None if joined is None else placed_images(self.model, ids, joined, images))

    def check_text_length(self, text: str, field: str) -> None:
        """A text too long to fit the context whatever it tokenizes to is refused before the
        tokenizer spends seconds on it: no token is longer than the vocabulary's longest."""
        if self.context_length and len(text) > self.context_length * self.longest_token:
            raise Refused(f"{len(text)} characters cannot fit the context of {self.context_length} tokens "
                          f"(a token here is at most {self.longest_token} characters)", field)

    @property
    def longest_token(self) -> int:
        if self._longest_token is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._longest_token = max(map(len, vocab), default=1)
        return self._longest_token

    # -- the row -------------------------------------------------------------------------------
    def row(self, request: EngineRequest, encoder=None, images=()) -> Row:
        """The request's Row, checked as far as the front checks before the queue."""
        if self.kind == "encoder-decoder":
            if encoder is None:
                raise Refused("this encoder-decoder model needs the encoder's outputs of the prompt", "prompt",
                              message="this encoder-decoder model needs the encoder's outputs of the prompt")
            from generation.families.seq2seq import decoder_start

            prompt = [decoder_start(self.ctx)]
        else:
            prompt = self.prompt_ids(request, images)
            if isinstance(prompt, tuple):  # a vision-language chat: its images go where an encoder's outputs go
                prompt, encoder = prompt
        if not prompt:
            raise Refused("has no tokens", request_field(request, "prompt"), message="the prompt has no tokens")
        self._check_logprobs(request)
        settings = dict(request.settings)
        if request.calls_tools and request.tool_choice != "auto":  # required, or a named function
            settings["structured_outputs"] = {"grammar": self._tool_grammar(request)}
        if request.stop_token_ids:
            settings["eos_token_id"] = [*self._eos(settings), *request.stop_token_ids]
        self._check_length(request, prompt, settings.get("max_new_tokens"))
        return Row(prompt, settings, encoder)

    def _check_logprobs(self, request: EngineRequest) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(request, name)
            if asked is not None and asked > self.max_logprobs:
                raise Refused(f"this server gives at most {self.max_logprobs} alternatives per token (asked {asked})"
                              if self.max_logprobs >= 0 else "this server runs without log-probabilities", name)

    def _tool_grammar(self, request: EngineRequest) -> str:
        from generation.text.tool_calls import ToolError, tool_format, tool_grammar

        name = request.tool_choice["function"]["name"] if isinstance(request.tool_choice, dict) else None
        try:
            return tool_grammar(tool_format(self.template), request.tools, name, request.parallel_tool_calls)
        except ToolError as e:
            raise Refused(str(e), e.field, message=str(e)) from None

    def _check_length(self, request: EngineRequest, prompt: list[int], budget) -> None:
        context = self.context_length
        room = context and context - (0 if budget == 0 else 1)  # a new token's place
        if room and len(prompt) > room:  # the prompt alone is too long, whatever max_tokens says
            field = "messages" if request.messages is not None else "prompt"
            raise Refused(f"the prompt is {len(prompt)} tokens; the model's context holds {context}"
                          + (", a new token included" if budget != 0 else ""), field)
        if isinstance(budget, int) and context and len(prompt) + budget > context:
            raise Refused(f"{budget} new tokens after a prompt of {len(prompt)} exceed the context of {context} "
                          f"tokens", "settings.max_new_tokens")

    def _eos(self, settings: dict) -> tuple:
        """The eos tokens a request's settings leave (ignore_eos gives none)."""
        if "eos_token_id" in settings:
            eos = settings["eos_token_id"]
            return tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)
        return tuple(self.ctx.settings.eos_token_id) if self.ctx is not None else ()

    # -- constraints ---------------------------------------------------------------------------
    @property
    def grammars(self):
        """The engine's grammar compiler (constraints.Grammars; None without a context)."""
        if self.ctx is None:
            return None
        from generation.logits.constraints import Grammars

        return Grammars.of(self.ctx)

    def compile_constraints(self, request: EngineRequest, settings: dict) -> None:
        """The request's tools (each one's parameters a JSON schema, whatever the tool_choice) and
        its constraint compiled within the grammar budget (cached: the engine reuses it)."""
        grammars = self.grammars
        if grammars is None:
            return
        if request.tools:
            from generation.text.tool_calls import ToolError, check_tool_schemas, check_tools

            try:
                check_tool_schemas(check_tools(request.tools), grammars.budget)
            except ToolError as e:
                raise Refused(str(e), e.field, message=str(e)) from None
        constraint = settings.get("structured_outputs")
        if constraint is not None:
            try:
                grammars.check(self.ctx.with_settings(structured_outputs=constraint).structured_outputs)
            except ValueError as e:
                raise refused(e, request_field(request, getattr(e, "setting", None))) from None


def template_message(message: dict, index: int, takes_images: bool = False) -> dict:
    """A message for the template. A text-only model's list content joins its text parts (an
    image part is refused by name); a vision-language model's keeps its parts, each image_url
    part as {"type": "image"} and each video_url or video part as {"type": "video"} (their
    features come from the vision encoder), as transformers' processors hand them to the
    template."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and takes_images:
                parts.append({"type": "image"})
            elif kind in ("video_url", "video") and takes_images:
                parts.append({"type": "video"})
            else:
                allowed = "text, image_url, video_url and video" if takes_images else "text"
                raise Refused(f"this model takes {allowed} parts only, not {kind!r}", f"messages.{index}.content.{j}",
                              message=f"messages[{index}].content[{j}]: this model takes {allowed} parts only, "
                                      f"not {kind!r}")
        message = {**message, "content": parts if takes_images else "".join(p["text"] for p in parts)}
    return message
