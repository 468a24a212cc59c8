"""LoRA adapters loaded and unloaded while the loop runs (a part of ContinuousBatcher and of the
engine process's parent: engine/batching.py, engine/process.py).

An adapter is read and checked where the call comes (a server's thread); it takes a place in the
bank at its first row's admission, on the loop's thread (runtime.lora.registry). Writing a place
no running row uses changes no running row's tokens: a run multiplies the places it does not use
by zeros. Unloading forgets the name at once; rows running with it finish with it."""

from __future__ import annotations


class AdapterCalls:
    """`ctx.model.lora`'s names, loads and unloads, refused by name where the model has no LoRA path."""

    def _adapters(self):
        adapters = self.ctx.model.lora
        if adapters is None:
            raise ValueError("max_loras: this engine was started without LoRA adapters (give --lora-modules or "
                             "--max-loras)")
        return adapters

    def adapter_names(self) -> list[str]:
        adapters = self.ctx.model.lora
        return [] if adapters is None else sorted(adapters.known)

    def load_adapter(self, name: str, path: str) -> None:
        """Know adapter `name` at `path` (a PEFT folder): runtime.lora.adapter.AdapterError naming
        what is wrong (lora_name, lora_path, the adapter's settings)."""
        self._adapters().add(name, path)

    def adapter_counts(self) -> tuple[int, int]:
        """(adapters in the bank's places now, adapters evicted from a place so far), for metrics."""
        adapters = self.ctx.model.lora
        return (0, 0) if adapters is None else (len(adapters.places), adapters.evictions)

    def knows_adapter(self, name: str, path: str) -> bool:
        """Whether adapter `name` is known at `path` already: a dict's lookup, so a server asks
        it on its event loop and reads (`know_adapter`, on a thread) only where not."""
        from pathlib import Path

        adapters = self.ctx.model.lora
        return adapters is not None and adapters.known.get(name) == Path(path)

    def know_adapter(self, name: str, path: str, again: bool = False) -> bool:
        """Know adapter `name` at `path`, as another replica was told to (a server's ingress sends
        the path with each request): nothing where it is known at that path already (`again`: read
        anew all the same), else read now; a name known already is unloaded first (its running rows
        finish with what they had). Whether it was read."""
        if not again and self.knows_adapter(name, path):
            return False
        if name in self._adapters().known:
            self.unload_adapter(name)
        self.load_adapter(name, path)
        return True

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`: KeyError where it is not known."""
        self._adapters().remove(name)
