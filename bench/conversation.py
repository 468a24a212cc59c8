"""A conversation's next turn against the prefix cache: 4 turns of chat and of Responses
(`previous_response_id`) on a warm `raymuter serve` (its defaults: the prefix cache keeps each
turn's prompt and answer), then the same requests, each alone, on a cold one
(`--prefix-cache-bytes 0`: every request computes its whole prompt).

    PYTHONPATH=. .venv/bin/python bench/conversation.py [--model FOLDER] [--max-tokens 128]

Greedy, streamed, a second between an answer and the next question (--think: the server
recomputes an int8 answer while idle, generation/core/keep.py). For each turn: the prompt tokens, the tokens the replica found cached
(usage's `cached_tokens`), what the bar asks for (the previous turn's prompt and answer minus
one block of 16), time to first token warm and cold, and whether the answer's text equals the
cold server's. The chat conversation's messages carry each answer as the client got it, so the
template re-renders it; Responses rebuilds it from the stored turn.
Default model: the real SmolLM2-135M genai build (bench/real_models.py), else the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import peers  # noqa: E402 - bench/peers.py's process trees

QUESTIONS = ["Explain how a hash table works, step by step.",
             "Now compare it with a binary search tree.",
             "Which of the two would you use for a phone book, and why?",
             "Summarize everything we discussed in a few sentences."]
BLOCK = 16
INSTRUCTIONS = "You are a patient teacher of computer science."  # Responses' system message: not the chat's prefix


def stream(url: str, path: str, body: dict) -> tuple[float, list[dict]]:
    """(seconds to the first text, every event's JSON) of one streamed request."""
    request = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    started, first, events = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            text = (event.get("delta") if event.get("type") == "response.output_text.delta" else
                    "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or []))
            if first is None and text:
                first = time.perf_counter() - started
    return first if first is not None else float("nan"), events


def chat_turn(url: str, name: str, messages: list[dict], max_tokens: int) -> dict:
    ttft, events = stream(url, "/v1/chat/completions", {
        "model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream_options": {"include_usage": True}})
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return {"ttft": ttft, "text": text, "prompt": usage["prompt_tokens"], "answer": usage["completion_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def responses_turn(url: str, name: str, request_input, max_tokens: int, previous: str | None = None,
                   store: bool = True) -> dict:
    """One streamed /v1/responses turn: `request_input` a text (with `previous` the response it
    continues) or the conversation's input items; its result, and its id."""
    body = {"model": name, "input": request_input, "max_output_tokens": max_tokens, "temperature": 0,
            "instructions": INSTRUCTIONS, "store": store}
    if previous:
        body["previous_response_id"] = previous
    ttft, events = stream(url, "/v1/responses", body)
    done = next(e["response"] for e in reversed(events) if isinstance(e.get("response"), dict)
                and e["response"].get("usage"))
    usage = done["usage"]
    answer = "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta")
    return {"ttft": ttft, "text": answer, "prompt": usage["input_tokens"], "answer": usage["output_tokens"],
            "cached": usage["input_tokens_details"]["cached_tokens"], "id": done["id"]}


def converse(url: str, name: str, max_tokens: int, think: float) -> dict[str, list[dict]]:
    """Both conversations on a warm server: each turn's result, and the chat's messages sent;
    `think` seconds between a turn's answer and the next question (a person reading)."""
    messages, chat = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        turn = chat_turn(url, name, list(messages), max_tokens)
        turn["messages"] = list(messages)
        chat.append(turn)
        messages.append({"role": "assistant", "content": turn["text"]})
        time.sleep(think)
    responses, previous = [], None
    for question in QUESTIONS:
        turn = responses_turn(url, name, question, max_tokens, previous)
        responses.append(turn)
        previous = turn["id"]
        time.sleep(think)
    return {"chat": chat, "responses": responses}


def cold(url: str, name: str, warm: dict, max_tokens: int) -> dict[str, list[dict]]:
    """The same requests on a cold server: the chat's messages as sent; Responses as one input
    list of the conversation so far (what previous_response_id stands for)."""
    chat = [chat_turn(url, name, turn["messages"], max_tokens) for turn in warm["chat"]]
    responses, items = [], []
    for question, turn in zip(QUESTIONS, warm["responses"]):
        items.append({"role": "user", "content": question})
        body_input = list(items)
        responses.append(responses_turn(url, name, body_input, max_tokens, store=False))
        items.append({"role": "assistant", "content": turn["text"]})
    return {"chat": chat, "responses": responses}


def start(model: str, logs: Path, extra: list[str]) -> tuple[peers.Managed, str, str]:
    from deployments.instance import free_port

    port = free_port()
    command = [str(Path(sys.executable).with_name("raymuter")), "serve", "--model", model, "--port", str(port), *extra]
    server = peers.Managed("raymuter", command, peers.clean_env(), logs / f"raymuter-{port}.log")
    url = f"http://127.0.0.1:{port}"
    name, _ = peers.wait_ready(server, url, "raymuter serve", 600)
    return server, url, name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: the real SmolLM2-135M genai build)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="warm and cold servers, each round (TTFT: medians)")
    ap.add_argument("--think", type=float, default=1.0, help="seconds between an answer and the next question")
    ap.add_argument("--server-arg", action="append", default=[], help="a flag added to both servers, e.g. "
                                                                      "--server-arg=--precision=fp32")
    args = ap.parse_args(argv)
    model = args.model or str(Path("~/.cache/raymuter/bench-models/real/genai").expanduser())
    logs = Path(tempfile.mkdtemp(prefix="raymuter-conversation-"))
    warm_runs, cold_runs = [], []
    for _ in range(args.rounds):
        for kind, extra in (("warm", []), ("cold", ["--prefix-cache-bytes", "0"])):
            server, url, name = start(model, logs, [*args.server_arg, *extra])
            try:
                if kind == "warm":
                    warm_runs.append(converse(url, name, args.max_tokens, args.think))
                else:
                    cold_runs.append(cold(url, name, warm_runs[-1], args.max_tokens))
            finally:
                server.stop()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu_model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{cpu_model}, {os.cpu_count()} CPUs, {model}, raymuter serve {' '.join(args.server_arg) or '(defaults)'}, "
          f"{args.rounds} round(s), greedy, max_tokens {args.max_tokens}, {args.think} s between turns; "
          f"TTFT medians over rounds\n")
    ok = True
    for kind in ("chat", "responses"):
        print(f"{kind}:\n")
        print("| turn | prompt tokens | cached | bar (previous prompt + answer - 16) | TTFT warm s | TTFT cold s | "
              "warm/cold | text equal |")
        print("|---|---|---|---|---|---|---|---|")
        for i in range(len(QUESTIONS)):
            turns = [run[kind][i] for run in warm_runs]
            colds = [run[kind][i] for run in cold_runs]
            warm_turn, cold_turn = turns[-1], colds[-1]
            bar = 0 if i == 0 else warm_runs[-1][kind][i - 1]["prompt"] + warm_runs[-1][kind][i - 1]["answer"] - BLOCK
            tw = statistics.median(t["ttft"] for t in turns)
            tc = statistics.median(t["ttft"] for t in colds)
            equal = all(w["text"] == c["text"] for w, c in zip(turns, colds))
            ok &= warm_turn["cached"] >= bar and equal
            print(f"| {i + 1} | {warm_turn['prompt']} | {warm_turn['cached']} | {bar} | {tw:.3f} | {tc:.3f} | "
                  f"{tw / tc:.2f} | {'yes' if equal else 'NO'} |")
        print()
    print(f"logs in {logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
