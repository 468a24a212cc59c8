"""The in_place, append and grow caches on device-owned buffers (cache/in_place_device.py,
cache/append_device.py, cache/grow_device.py, over CPU OrtValues: the code a CUDA session runs, their moves as small
graphs on the session's provider), and the ledger of what crosses host <-> device
(runtime/device.py).

Invariants: every row gets transformers' greedy tokens, and the host cache's tokens and
log-probabilities when sampling, preempted, reusing prefixes or searching beams; a decode step
of 32 rows moves at most the read logits plus 4 KB of inputs; relayouts and beam reorders move
no data; the host cache counts what the device cache moves.
(`RAYMUTER_BUFFERS=device pytest tests/generation` runs every in_place, append and grow test on
device buffers.)
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.engine.scheduler import Scheduler
from generation.params.checks import SettingError
from generation.runtime.device import Device, Ledger

# folder (+fused: the rewrite), oracle model, cache mode
GRAPHS = [("llama-genai", "llama", "in_place"), ("qwen2-optimum+fused", "qwen2", "in_place"),
          ("llama-optimum", "llama", "append"), ("qwen2-optimum", "qwen2", "append"), ("llama-merged", "llama", "append"),
          ("gpt2-grow", "gpt2", "grow")]
FOLDERS = [f for f, _, _ in GRAPHS]
DATA = ("prompt", "inputs", "logits", "insert", "prefix_restore", "prefix_keep")  # what is not a move's indices
MAX_NEW = 24


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f.removesuffix("+fused")], fuse=f.endswith("+fused")) for f in FOLDERS}


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(range(0, 38, 3), seed=5)


def test_the_moves_equal_numpy():
    """Each device move against the numpy it stands for (float32 buffers, an int64 mask)."""
    device, ledger, rng = Device.for_provider("cpu"), Ledger(), np.random.default_rng(0)
    buffer = device.zeros((4, 2, 8, 3), np.float32)
    expected = np.zeros((4, 2, 8, 3), np.float32)
    assert np.array_equal(buffer.copy_to_host(), expected)
    for row, length in ((0, 5), (2, 8), (3, 1)):
        values = rng.standard_normal((2, length, 3)).astype(np.float32)
        device.write_row(buffer, row, values, ledger)
        expected[row] = 0
        expected[row, :, :length] = values
    assert np.array_equal(buffer.copy_to_host(), expected)
    device.move_rows([buffer], [1, 0, 3], [0, 3, 0], ledger)  # a swap among them: each reads the old rows
    expected[[1, 0, 3]] = expected[[0, 3, 0]]
    assert np.array_equal(buffer.copy_to_host(), expected)
    for shape in ((8, 2, 16, 3), (2, 2, 4, 3), (4, 2, 8, 3)):
        moved = device.relayout(buffer, shape)
        want = np.zeros(shape, np.float32)
        keep = tuple(slice(0, min(a, b)) for a, b in zip(shape, expected.shape))
        want[keep] = expected[keep]
        assert np.array_equal(moved.copy_to_host(), want), shape
    mask = device.zeros((5, 6), np.int64)
    device.set_lengths(mask, np.arange(5), [0, 3, 6, 1, 2], ledger)
    want = (np.arange(6) < np.maximum([0, 3, 6, 1, 2], 1)[:, None]).astype(np.int64)
    assert np.array_equal(mask.copy_to_host(), want)
    device.mark(mask, np.array([[0, 1], [1, 3], [4, 5]], np.int64))
    want[[0, 1, 4], [1, 3, 5]] = 1
    assert np.array_equal(mask.copy_to_host(), want)
    assert ledger.bytes["indices"] > 0 and all(ledger.bytes[c] == 0 for c in DATA)


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("folder, name, mode", GRAPHS, ids=FOLDERS)
def test_greedy_equals_transformers(models, oracle, prompts, folder, name, mode, steps):
    ctx = generation.context(models[folder], buffers="device", max_new_tokens=MAX_NEW, prompt_steps=steps)
    assert ctx.buffers == "device" and ctx.cache_mode == mode
    rows = generation.generate(ctx, prompts)
    assert rows == [oracle.greedy(name, p, MAX_NEW) if p else [] for p in prompts]
    small = generation.compile(ctx, batch_size=3)  # later rows into slots that finished rows left
    assert generation.generate(small, prompts[::-1]) == rows[::-1]


def test_the_state_holds_device_buffers(models):
    state = generation.new_state(generation.context(models["llama-genai"], buffers="device"), slots=4, capacity=64)
    assert type(state.cache).__name__ == "DeviceInPlaceCache" and state.cache.memory == "device"
    assert all(type(b).__name__ == "DeviceArray" for b in state.cache.buffers.values())
    host = generation.new_state(generation.context(models["llama-genai"], buffers="host"), slots=4, capacity=64)
    assert host.cache.memory == "host" and all(isinstance(b, np.ndarray) for b in host.cache.buffers.values())
    append = generation.new_state(generation.context(models["llama-optimum"], buffers="device"), slots=4, capacity=64)
    assert type(append.cache).__name__ == "DeviceAppendCache"
    assert all(type(b).__name__ == "DeviceArray" for b in (*append.cache.flat, append.cache._mask))


def both(model, **settings):
    return {buffers: generation.context(model, buffers=buffers, **settings) for buffers in ("host", "device")}


@pytest.mark.parametrize("folder", FOLDERS)
def test_sampling_and_log_probabilities_equal_the_host_cache(models, prompts, folder):
    out = {}
    for buffers, ctx in both(models[folder], max_new_tokens=MAX_NEW, do_sample=True, temperature=0.9, top_k=30,
                             token_logprobs=True, top_logprobs=2).items():
        out[buffers] = generation.generate(ctx, prompts[1:], seeds=list(range(len(prompts) - 1)))
    for host, device in zip(out["host"], out["device"]):
        assert host.tokens == device.tokens
        np.testing.assert_array_equal(host.logprobs, device.logprobs)


@pytest.mark.parametrize("folder", ["llama-genai", "llama-optimum", "gpt2-grow"])
def test_beams_equal_the_host_cache(models, prompts, folder):
    out = {buffers: generation.beam_search(generation.compile(ctx, 4), prompts[1:6], [0] * 5)
           for buffers, ctx in both(models[folder], max_new_tokens=12, num_beams=3,
                                    num_return_sequences=3).items()}
    for host, device in zip(out["host"], out["device"]):
        assert [(h.tokens, h.score) for h in host] == [(h.tokens, h.score) for h in device]


def run(scheduler, prompts, settings):
    jobs = [scheduler.job(p, 100 + i, dict(settings)) for i, p in enumerate(prompts)]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    return [(job.reason, job.tokens, job.logprobs) for job in jobs]


@pytest.mark.parametrize("folder, kind", [("llama-genai", "preempted"), ("llama-genai", "prefix cache"),
                                          ("llama-genai", "chunked prefill"), ("llama-optimum", "prefix cache"),
                                          ("llama-optimum", "chunked prefill"), ("gpt2-grow", "prefix cache")])
def test_the_scheduler_on_device_buffers_equals_the_host_cache(models, prompts_of, folder, kind):
    """Rows preempted and resumed by a memory budget, prompts reusing cached prefixes (a finished
    row's decoded blocks too, read back from the device), prompts filled in chunks: the device
    cache's rows are the host cache's."""
    shared = prompts_of([20], seed=9)[0]
    prompts = [shared + p for p in prompts_of(list(range(3, 15)), seed=11)]
    settings = dict(max_new_tokens=40, eos_token_id=[], do_sample=True, temperature=0.8, top_k=40)
    out = {}
    for buffers, ctx in both(models[folder], token_logprobs=True).items():
        options = {}
        if kind == "preempted":
            options["kv_cache_bytes"] = Scheduler(ctx, 8, 128).state.cache.footprint(8, 48)
        elif kind == "prefix cache":
            options["prefix_cache_bytes"] = 1 << 22
        else:
            options["prefill_chunk_tokens"] = 8
        scheduler = Scheduler(ctx, 8, 128, **options)
        out[buffers] = run(scheduler, prompts, settings)
        if kind == "prefix cache":  # the first row's conversation goes on: its answer's blocks were kept
            hits = scheduler.prefix.hits
            out[buffers] += run(scheduler, [prompts[0] + out[buffers][0][1] + [5, 6, 7]], settings)
            assert scheduler.prefix.hits - hits == (len(prompts[0]) + 39) // 16 * 16  # its prompt and answer
            kept = scheduler.ledger.bytes["prefix_keep"]
            assert kept > 0 and kept == out.setdefault("kept", kept)  # finished rows' blocks read back
        if kind == "preempted":
            assert scheduler.preemptions > 0
        if kind == "prefix cache":
            assert scheduler.prefix.hits > 0
            assert scheduler.ledger.bytes["prefix_restore"] > 0 and scheduler.ledger.bytes["insert"] > 0
    for (reason, tokens, logprobs), (reason_d, tokens_d, logprobs_d) in zip(out["host"], out["device"]):
        assert (reason, tokens) == (reason_d, tokens_d)
        np.testing.assert_allclose(logprobs, logprobs_d, rtol=0, atol=2e-5)


def seated(ctx, prompts):
    """A state of 32 slots, every slot running one of `prompts`."""
    state = generation.new_state(ctx, slots=32, capacity=128)
    state, _ = generation.admit(ctx, state, list(range(32)), prompts, list(range(32)), max_new=[60] * 32)
    return state


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_decode_step_moves_the_read_logits_and_a_few_inputs(models, prompts_of, folder):
    """32 rows a step: at most 32 x vocab x 4 bytes of logits + 4 KB, nothing else; the host
    cache counts what the device cache moves."""
    prompts = prompts_of([int(n) for n in np.random.default_rng(1).integers(1, 40, 32)], seed=2)
    counted = {}
    for buffers, ctx in both(models[folder], max_new_tokens=60, eos_token_id=[]).items():
        state = seated(ctx, prompts)
        ledger = state.cache.ledger
        for _ in range(3):
            before = ledger.bytes
            state, _ = generation.step(ctx, state)
            moved = {cause: ledger.bytes[cause] - before[cause] for cause in ledger.bytes}
            vocab = ctx.model.vocab_size
            assert moved["logits"] == 32 * vocab * 4
            assert moved["logits"] + moved["inputs"] + moved["indices"] <= 32 * vocab * 4 + 4096, moved
            assert all(moved[c] == 0 for c in ("prompt", "insert", "prefix_restore", "prefix_keep")), moved
        assert ledger.steps >= 3 and ledger.rows >= 96
        counted[buffers] = {c: ledger.bytes[c] for c in DATA}
    assert counted["host"] == counted["device"]


def test_relayouts_and_beam_reorders_move_no_data(models, prompts_of):
    """fit() to larger and smaller classes and copy_rows() (a beam step's reorder) leave every
    data cause unchanged on both caches; the device buffers then hold what the host's hold."""
    prompts = prompts_of([5, 17, 9, 30], seed=4)
    caches = {}
    for buffers, ctx in both(models["llama-genai"], max_new_tokens=8).items():
        state = generation.new_state(ctx, slots=8, capacity=128)
        state, _ = generation.admit(ctx, state, [0, 1, 2, 3], prompts, [0, 1, 2, 3])
        cache, ledger = state.cache, state.cache.ledger
        before = {c: ledger.bytes[c] for c in DATA}
        cache.fit(8, 128)
        cache.copy_rows(np.array([4, 5, 0]), np.array([1, 3, 3]), 31)
        cache.fit(6, 64)
        assert (cache.held, cache.length) == (8, 64)
        assert {c: ledger.bytes[c] for c in DATA} == before
        caches[buffers] = cache
    host, device = caches["host"], caches["device"].host_buffers()
    lengths = [30, 17, 9, 30, 17, 30]  # the rows each slot holds after the moves (slot 4 <- 1, 5 and 0 <- 3)
    for name, buffer in host.buffers.items():
        for slot, length in enumerate(lengths):
            np.testing.assert_array_equal(device[name][slot, :, :length], buffer[slot, :, :length], err_msg=name)
    np.testing.assert_array_equal(device["attention_mask"], host.mask)


def test_buffers_setting_errors(models, load_model, monkeypatch):
    from model_builders.windows import ensure_window_models

    with pytest.raises(SettingError, match="buffers must be one of host, device") as e:
        generation.context(models["llama-genai"], buffers="gpu")
    assert e.value.setting == "buffers"
    windowed = load_model(ensure_window_models()["mistral-optimum"])  # a sliding window's append cache
    with pytest.raises(SettingError, match="a sliding window's append cache keeps its buffers on the host"):
        generation.context(windowed, buffers="device")
    monkeypatch.delenv("RAYMUTER_BUFFERS", raising=False)
    assert generation.context(models["llama-optimum"]).buffers == "host"  # the CPU's default
    monkeypatch.setenv("RAYMUTER_BUFFERS", "device")
    assert generation.context(models["llama-optimum"]).buffers == "device"
    assert generation.context(windowed).buffers == "host"


def assert_few_bytes(ledgers: dict, vocab: int, row_inputs: int) -> None:
    """The device cache's steps moved their rows' logits and `row_inputs` bytes a row (and a few a
    step), their rows crossed once at insert (prefilled apart), and the host cache counted the same."""
    ledger = ledgers["device"]
    moved = ledger.bytes
    assert ledger.rows > 0 and moved["logits"] == ledger.rows * vocab * 4
    assert moved["inputs"] <= ledger.rows * row_inputs + ledger.steps * 8 and moved["insert"] > 0
    assert {c: v for c, v in moved.items() if c in DATA} == {c: v for c, v in ledgers["host"].bytes.items() if c in DATA}


@pytest.mark.parametrize("folder", ["qwen2vl-onnx", "idefics3-onnx"])
def test_vision_rows_on_device_buffers(vision_paths, load_model, folder):
    """Image prompts (their features scattered into the prompt's embeddings, prefilled apart and
    inserted; Qwen2-VL's 3-D positions) decode on device buffers as on the host, each step's
    embeddings made on the device from the ids: a step moves its logits and a few bytes a row."""
    from generation.tasks import image_text_to_text

    model = load_model(vision_paths[folder])
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((13, 21), (30, 17))]
    prompts = [[[1, 17, 23, 44]], [[1, 17, 23], images[0], [44, 55, 66]], [[1, 5], images[1], [9, 8, 7]]]
    out, ledgers = {}, {}
    for buffers, ctx in both(model, max_new_tokens=10).items():
        ctx = generation.compile(ctx, batch_size=2)
        out[buffers] = [r.tokens for r in image_text_to_text(ctx, prompts, seeds=[0, 1, 2])]
        ledgers[buffers] = ctx.spare_states[0].cache.ledger
        assert ctx.spare_states[0].cache.memory == buffers
    assert out["device"] == out["host"] and all(out["host"])
    positions = 24 if folder == "qwen2vl-onnx" else 8  # [3, B, 1] or [B, 1] int64
    assert_few_bytes(ledgers, model.vocab_size, 8 + positions + 8 + 8)  # ids, positions, read, length


@pytest.mark.parametrize("folder", ["llama-genai", "llama-optimum", "gpt2-grow"])
@pytest.mark.parametrize("assistant", ["prompt lookup", "draft"])
def test_assisted_decoding_on_device_buffers(models, prompts_of, folder, assistant):
    """Candidates verified and rewound on device buffers (the target's and the draft's) give the
    host cache's tokens."""
    base = prompts_of([9, 14], seed=6)
    prompts = [p + p[:6] + p for p in base]  # repeats: prompt lookup finds candidates
    settings = (dict(prompt_lookup_num_tokens=4) if assistant == "prompt lookup"
                else dict(draft=models[folder], num_assistant_tokens=3))
    out = {buffers: generation.generate(ctx, prompts) for buffers, ctx in both(models[folder], max_new_tokens=16,
                                                                             **settings).items()}
    assert out["device"] == out["host"] == generation.generate(generation.context(models[folder], max_new_tokens=16),
                                                               prompts)


@pytest.mark.parametrize("folder", ["marian-optimum", "t5-optimum", "bart-optimum", "marian-unmerged"])
@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(do_sample=True, top_k=20)],
                         ids=["greedy", "beams", "sampling"])
def test_encoder_decoder_rows_on_device_buffers(s2s, load_model, folder, settings):
    """Groups of rows of one decoder length, their cross caches and sources on the device (rows of
    different source lengths joining a group padded there): the host cache's tokens; a step moves
    its ids and its logits."""
    from generation.tasks import text_to_text

    model = load_model(s2s[folder])
    sources = [[int(t) for t in np.random.default_rng(n).integers(3, 90, n)] for n in (3, 9, 5, 14, 7)]
    out, ledgers = {}, {}
    for buffers, ctx in both(model, max_new_tokens=12, **settings).items():
        ctx = generation.compile(ctx, batch_size=4)
        out[buffers] = [r.tokens for r in text_to_text(ctx, sources, seeds=list(range(5)))]
        ledgers[buffers] = ctx.spare_states[0].cache.ledger
        assert ctx.spare_states[0].cache.memory == buffers
    assert out["device"] == out["host"] and all(out["host"])
    assert_few_bytes(ledgers, model.vocab_size, 8)  # ids


def drive(ctx, prompts, max_new):
    """Every prompt admitted at once into 8 slots and stepped to its own end: (tokens, the cache)."""
    state = generation.new_state(ctx, slots=8, capacity=96)
    state, first = generation.admit(ctx, state, list(range(len(prompts))), prompts, [1] * len(prompts),
                                    max_new=max_new)
    tokens = [[int(t)] for t in first.token]
    while state.live.any():
        state, out = generation.step(ctx, state)
        for slot in np.flatnonzero(out.token >= 0):
            tokens[slot].append(int(out.token[slot]))
        for slot in np.flatnonzero(out.finished):
            state = generation.release(ctx, state, int(slot))
    return tokens, state.cache


def test_cuda_graph_classes_bind_only_device_buffers(models, prompts_of):
    """With CUDA graphs (a model loaded with cuda_graphs=True on a CUDA node; here the same cache
    over CPU OrtValues, where onnxruntime ignores the graph ids), every decode binding, one per
    class of rows and layout, binds device buffers only (fixed addresses: what a captured graph
    replays), each class its own gpu_graph_id, prompts uncaptured, the buffers laid out once; the
    rows equal the host cache's."""
    from dataclasses import replace

    from generation.runtime.device import DeviceArray

    prompts, max_new = prompts_of([3, 17, 9, 30, 5], seed=8), [20, 6, 14, 3, 9]  # rows end apart: leading runs
    settings = dict(do_sample=True, top_k=30, eos_token_id=[])
    host, _ = drive(generation.context(models["llama-genai"], **settings), prompts, max_new)
    ctx = generation.context(replace(models["llama-genai"], cuda_graphs=True), buffers="device", **settings)
    got, cache = drive(ctx, prompts, max_new)
    assert got == host
    assert cache.graphs and cache.run_options is None and not cache.sized
    assert (cache.held, cache.length) == (8, 96)  # laid out once, whole: a relayout would move the addresses
    spans = {key: found[0] for key, found in cache.__dict__.get("_spans", {}).items() if isinstance(key, int)}
    assert spans  # rows ended: later steps ran the leading rows, a class of their own
    for binding in [cache.binding, *spans.values()]:
        assert binding._held and all(isinstance(a, DeviceArray) for a in binding._held.values()), binding._held
    ids = cache._graph_ids
    assert sorted(ids.values()) == list(range(len(ids))) and len(ids) > len(spans)
    for rows, binding in [(cache.held, cache.binding), *spans.items()]:
        assert binding.options.get_run_config_entry("gpu_graph_id") == str(ids[rows, cache.held, cache.length])
    assert cache._prompt_binding.options.get_run_config_entry("gpu_graph_id") == "-1"
    with pytest.raises(generation.ModelError, match="cuda_graphs needs the CUDA provider"):
        generation.load(models["llama-genai"].folder, provider="cpu", cuda_graphs=True)
