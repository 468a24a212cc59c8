"""The LoRA adapter names every ingress replica shares (deployments.services.adapter_names, a
store of the Records deployment).

Invariant: the names start as --lora-modules gives them; a load adds a name once (a taken name is
refused naming lora_name, even from many threads at once); an unload removes it (an unknown name
is a 404-kind refusal naming lora_name); what is asked is a copy.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.errors import NotFound, RequestError
from deployments.services.adapter_names import AdapterNames


def test_names_are_added_once_and_removed_by_name():
    names = AdapterNames({"a1": "/adapters/a1"})
    names.add_adapter("a2", "/adapters/a2")
    assert names.adapter_paths() == {"a1": "/adapters/a1", "a2": "/adapters/a2"}
    with pytest.raises(RequestError) as e:
        names.add_adapter("a1", "/elsewhere")
    assert e.value.field == "lora_name" and not isinstance(e.value, NotFound)
    names.adapter_paths()["a9"] = "/x"  # a copy: the store is unchanged
    names.remove_adapter("a1")
    assert names.adapter_paths() == {"a2": "/adapters/a2"}
    with pytest.raises(NotFound) as e:
        names.remove_adapter("a1")
    assert e.value.field == "lora_name"


def test_of_many_loads_of_one_name_at_once_one_succeeds():
    names = AdapterNames()

    def load(i: int) -> bool:
        try:
            names.add_adapter("x", f"/adapters/{i}")
            return True
        except RequestError:
            return False

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(load, range(64))) == 1
    assert list(names.adapter_paths()) == ["x"]
