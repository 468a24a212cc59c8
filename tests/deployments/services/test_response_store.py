"""The stored responses of /v1/responses (deployments/services/response_store.py): bounded in
bytes with the least recently used going first, a TTL, cancel marks, a running record's heartbeat
and events, a folder (private) that a new store reads back, and every method safe from Serve's
thread pool."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from deployments.services.response_store import STALE_SECONDS, ResponseStore


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


def test_cancel_marks_only_a_running_response_and_its_owner_hears_it_at_its_beat():
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60)
    store.put(record("resp_run", status="in_progress"))
    store.put(record("resp_done"))
    assert store.beat("resp_run", 0, [])["run"] == "on"
    assert store.cancel_response("resp_run")["cancel"] is True and store.beat("resp_run", 0, [])["run"] == "cancel"
    assert store.update(record("resp_run", status="in_progress")) and store.get("resp_run")["cancel"]  # kept
    assert "cancel" not in store.cancel_response("resp_done") and store.beat("resp_done", 0, [])["run"] == "stop"
    assert store.cancel_response("resp_missing") is None and store.beat("resp_missing", 0, [])["run"] == "stop"


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
    running = second.get("resp_running")["response"]  # no heartbeat since the old store's last write
    assert running["status"] == "failed" and "stopped" in running["error"]["message"]
    old = ResponseStore(max_bytes=2**20, ttl_seconds=1e-9, folder=str(tmp_path))  # every file past its TTL
    assert old.stats()["responses"] == 0 and not list(tmp_path.iterdir())


def test_an_id_that_is_not_a_file_name_stays_in_memory(tmp_path):
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path))
    store.put(record("resp_../../etc"))
    assert store.get("resp_../../etc") is not None and not list(tmp_path.iterdir())


def test_a_running_record_whose_owner_stops_beating_is_failed_for_every_reader():
    clock = Clock()
    store = ResponseStore(max_bytes=2**20, ttl_seconds=3600, clock=clock)
    store.put(record("resp_run", status="in_progress"))
    for _ in range(5):  # an owner that beats lives on, however long it runs
        clock.now += STALE_SECONDS - 1
        assert store.beat("resp_run", 0, [])["run"] == "on"
    assert store.get("resp_run")["response"]["status"] == "in_progress"
    clock.now += STALE_SECONDS + 1
    failed = store.cancel_response("resp_run")  # the first reader after: the same answer as every other
    assert failed["response"]["status"] == "failed" and "stopped" in failed["response"]["error"]["message"]
    assert "cancel" not in failed and store.get("resp_run")["response"] == failed["response"]
    assert store.beat("resp_run", 0, [])["run"] == "stop"  # an owner only slow: it stops, and writes nothing
    assert store.update(record("resp_run", status="completed")) is False
    assert store.get("resp_run")["response"]["status"] == "failed"


def test_a_response_deleted_while_it_runs_stays_deleted(tmp_path):
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path))
    store.put(record("resp_run", status="queued"))
    assert store.update(record("resp_run", status="in_progress"))
    assert store.delete("resp_run")
    assert store.beat("resp_run", 0, [])["run"] == "stop"
    assert store.update(record("resp_run", status="cancelled")) is False  # the run's end: not written back
    assert store.get("resp_run") is None and not list(tmp_path.iterdir())
    assert ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path)).get("resp_run") is None


def test_a_streamed_records_events_come_with_its_beats_and_count_in_its_bytes(tmp_path):
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path))
    store.put({**record("resp_s", status="queued"), "events": ["e0", "e1"]})
    assert store.beat("resp_s", 2, ["e2", "e3"]) == {"run": "on", "kept": 4}
    assert store.beat("resp_s", 4, []) == {"run": "on", "kept": 4}
    found = store.events_after("resp_s", 1)
    assert found["events"] == ["e2", "e3"] and found["last"] == "e3" and found["response"]["status"] == "queued"
    assert "events" not in store.get("resp_s") and store.stats()["bytes"] > len(json.dumps(record("resp_s")))
    assert store.events_after("resp_s", 3)["events"] == [] and store.events_after("resp_unknown", -1) is None
    store.put(record("resp_plain"))
    assert store.events_after("resp_plain", -1)["events"] is None  # not a background stream: none kept
    # a restarted store holds the events of the last write (e0, e1): the owner sends again from there
    again = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(tmp_path))
    assert again.beat("resp_s", 4, ["e4"]) == {"run": "on", "kept": 2}
    assert again.beat("resp_s", 2, ["e2", "e3", "e4"])["kept"] == 5
    assert again.events_after("resp_s", -1)["events"] == ["e0", "e1", "e2", "e3", "e4"]


def test_the_response_folder_is_private_as_the_default_folders_are(tmp_path):
    """--response-folder (app arg response_folder): the folder 0700, each stored conversation 0600."""
    folder = tmp_path / "kept" / "responses"
    store = ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(folder))
    store.put(record("resp_a"))
    store.put(record("resp_a", status="incomplete"))  # written again: still private
    assert folder.stat().st_mode & 0o777 == 0o700
    assert [(p.name, p.stat().st_mode & 0o777) for p in folder.iterdir()] == [("resp_a.json", 0o600)]
    given = tmp_path / "given"  # a folder that exists already, open to all: made private too
    given.mkdir(mode=0o755)
    given.chmod(0o755)
    ResponseStore(max_bytes=2**20, ttl_seconds=60, folder=str(given)).put(record("resp_b"))
    assert given.stat().st_mode & 0o777 == 0o700 and (given / "resp_b.json").stat().st_mode & 0o777 == 0o600


@pytest.fixture
def switching_often():
    """Threads switched every microsecond: a race that needs a switch at one bytecode shows at once."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_puts_and_gets_from_many_threads_past_the_bytes(switching_often):
    """Serve runs the Records replica's (the store's) sync methods on its thread pool (RAY_SERVE_RUN_SYNC_IN_THREADPOOL,
    on by default), several at once: a put evicting while another reads raised `OrderedDict mutated
    during iteration` (a 500 on POST /v1/responses)."""
    one = len(json.dumps(record("resp_0_0", size=2000), separators=(",", ":")))
    store = ResponseStore(max_bytes=50 * one, ttl_seconds=60)
    errors = []

    def writes(t: int):
        try:
            for k in range(2000):
                store.put(record(f"resp_{t}_{k}", size=2000))
                store.get(f"resp_{t}_{k // 2}")
        except Exception as e:  # noqa: BLE001 - what a request would have answered 500
            errors.append(repr(e))

    threads = [threading.Thread(target=writes, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = store.stats()
    assert stats["bytes"] == sum(len(json.dumps(store.get(key), separators=(",", ":"))) for key in list(store.records))
    assert 45 <= stats["responses"] <= 50 and stats["bytes"] <= 50 * one
