"""The stored responses of /v1/responses (deployments/services/response_store.py): bounded in
bytes with the least recently used going first, a TTL, cancel marks, and a folder that a new
store reads back."""

from __future__ import annotations

import json

from deployments.services.response_store import ResponseStore


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def record(key: str, status: str = "completed", size: int = 0) -> dict:
    return {"response": {"id": key, "status": status, "background": True}, "input_items": [{"x": "a" * size}],
            "history": [], "replica": None}


def test_the_least_recently_used_go_first_when_the_bytes_are_spent():
    one = len(json.dumps(record("resp_a", size=100), separators=(",", ":")))
    store = ResponseStore(max_bytes=3 * one, ttl_seconds=60)
    for key in ("resp_a", "resp_b", "resp_c"):
        store.put(record(key, size=100))
    assert store.get("resp_a") is not None  # read: now the most recently used
    store.put(record("resp_d", size=100))
    assert store.get("resp_b") is None and all(store.get(k) for k in ("resp_a", "resp_c", "resp_d"))
    assert store.stats()["bytes"] <= 3 * one
    store.put(record("resp_huge", size=10 * one))  # larger than the whole store: not kept, nothing evicted
    assert store.get("resp_huge") is None and store.stats()["responses"] == 3


def test_a_record_expires_after_its_ttl_and_a_delete_is_final():
    clock = Clock()
    store = ResponseStore(max_bytes=2**20, ttl_seconds=10, clock=clock)
    store.put(record("resp_a"))
    store.put(record("resp_b"))
    clock.now += 9
    assert store.get("resp_a") is not None
    clock.now += 2
    assert store.get("resp_a") is None and store.stats()["responses"] == 1  # expired, and forgotten
    assert store.delete("resp_b") is False  # expired too: nothing to delete
    store.put(record("resp_c"))
    assert store.delete("resp_c") is True and store.get("resp_c") is None and store.delete("resp_c") is False


def test_cancel_marks_only_a_running_response():
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60)
    store.put(record("resp_run", status="in_progress"))
    store.put(record("resp_done"))
    assert not store.cancelled("resp_run")
    assert store.cancel("resp_run")["cancel"] is True and store.cancelled("resp_run")
    assert "cancel" not in store.cancel("resp_done") and not store.cancelled("resp_done")
    assert store.cancel("resp_missing") is None and store.cancelled("resp_missing")  # gone: its runner stops


def test_a_store_reads_its_folder_back(tmp_path):
    clock = Clock()
    first = ResponseStore(max_bytes=2**20, ttl_seconds=100, folder=str(tmp_path), clock=clock)
    first.put(record("resp_kept"))
    first.put(record("resp_running", status="in_progress"))
    first.put(record("resp_gone"))
    first.delete("resp_gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_kept.json", "resp_running.json"]
    second = ResponseStore(max_bytes=2**20, ttl_seconds=100, folder=str(tmp_path))
    assert second.get("resp_kept") == record("resp_kept") and second.get("resp_gone") is None
    running = second.get("resp_running")["response"]  # its runner went with the old store's ingress
    assert running["status"] == "failed" and "restarted" in running["error"]["message"]
    old = ResponseStore(max_bytes=2**20, ttl_seconds=1e-9, folder=str(tmp_path))  # every file past its TTL
    assert old.stats()["responses"] == 0 and not list(tmp_path.iterdir())


def test_an_id_that_is_not_a_file_name_stays_in_memory(tmp_path):
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path))
    store.put(record("resp_../../etc"))
    assert store.get("resp_../../etc") is not None and not list(tmp_path.iterdir())
