"""The LoRA adapters a request's `model` may name, shared by every ingress replica (a store of the
Records deployment): name -> where the adapter lives. `--lora-modules` names the first; vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter add and remove the others, through whichever
ingress replica answers them. The decoder replicas learn an adapter from the requests that name it
(GenerateRequest.adapter_path), so a load reaches every replica without a call to each."""

from __future__ import annotations

import threading

from ..errors import NotFound, RequestError


class AdapterNames:
    """name -> path (a folder or hub id), in the order they were added. Serve runs these verbs on
    its thread pool, so they hold a lock: two loads of one name never both succeed."""

    def __init__(self, modules: dict[str, str] | None = None):
        self._paths: dict[str, str] = dict(modules or {})
        self._lock = threading.Lock()

    def adapter_paths(self) -> dict[str, str]:
        with self._lock:
            return dict(self._paths)

    def add_adapter(self, name: str, path: str) -> None:
        """RequestError naming lora_name where the name is taken (unload it first)."""
        with self._lock:
            if name in self._paths:
                raise RequestError(f"lora_name: '{name!s:.200}' is loaded already (unload it first)", "lora_name")
            self._paths[name] = path

    def remove_adapter(self, name: str) -> None:
        """NotFound naming lora_name where no adapter has the name."""
        with self._lock:
            removed = self._paths.pop(name, None)
        if removed is None:
            raise NotFound(f"lora_name: '{name!s:.200}' is not loaded", "lora_name")
