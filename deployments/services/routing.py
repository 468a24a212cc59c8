"""Prefix-aware routing to decoder replicas: a request goes to the replica that most likely holds
its prompt's prefix in its prefix cache (generation/cache/prefix.py), as Ray Serve LLM's
PrefixCacheAffinityRouter does.

The router runs where the calls start (the ingress replica's handle) and never sees tokens: it
names a request's prompt by a hash chain over blocks of its text (the prompt, or the chat's tools
and messages in order, so a longer conversation extends the chain of a shorter one), and
remembers which replica it last sent each block to. A request goes to the replica holding its
deepest known block when that covers at least `match_rate` of its blocks and that replica's queue
is not `imbalanced_requests` longer than the shortest; otherwise to the least loaded replica,
those that hold the fewest blocks first (so new prefixes spread). Each ingress replica learns on
its own: with several, a prefix may live on one decoder replica per ingress replica. A request
that names its replica (GenerateRequest.affinity: a stored response's next turn, from any ingress
replica) goes there first, on the same condition of load.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter

ROUTERS = {
    "prefix": "deployments.services.routing.PrefixRouter",
    "power_of_two": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    "round_robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
}


def prompt_text(request) -> str | None:
    """The text a GenerateRequest's prompt starts with, as far as routing needs it, after its LoRA
    adapter's name where it names one (its cached blocks are that adapter's: the same text with
    another adapter, or none, is another prefix); None for a call that is not a generation."""
    text = _prompt_text(request)
    adapter = (getattr(request, "settings", None) or {}).get("adapter") if text is not None else None
    return text if adapter is None else f"\x1dlora\x1f{adapter}\x1d{text}"


def _prompt_text(request) -> str | None:
    prompt, messages = getattr(request, "prompt", None), getattr(request, "messages", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))
    if not messages:
        return None
    tools = getattr(request, "tools", None)
    parts = [json.dumps(tools, sort_keys=True, default=str)] if tools else []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text") or json.dumps(p, sort_keys=True, default=str) for p in content
                              if isinstance(p, dict))
        parts.append(f"\x1e{message.get('role')}\x1f{content or ''}")
    return "".join(parts)


def block_chain(text: str, block_chars: int, max_blocks: int) -> list[bytes]:
    """The hash chain of `text`'s first full blocks of `block_chars` characters."""
    data, chain, previous = text.encode("utf-8", "surrogatepass"), [], b""
    for start in range(0, min(len(data) // block_chars, max_blocks) * block_chars, block_chars):
        previous = hashlib.blake2b(previous + data[start:start + block_chars], digest_size=12).digest()
        chain.append(previous)
    return chain


def ranked(chain: list[bytes], owners, candidates: list, queue_lens: dict, held: dict, match_rate: float,
           imbalanced_requests: int, affinity: str | None = None) -> tuple[list, bool]:
    """The candidates (replica ids) in the order to try them, and whether the first is the
    prefix's owner. `owners` maps block hashes to the replica that got them; `queue_lens` the
    known queue lengths; `held` the blocks each replica got; `affinity` the unique id of a
    replica the request asks for."""
    alive = set(candidates)
    load = {r: queue_lens.get(r) or 0 for r in candidates}
    by_load = sorted(candidates, key=lambda r: (load[r], held.get(r, 0)))
    wanted = [r for r in candidates if affinity is not None and getattr(r, "unique_id", r) == affinity]
    if wanted and load[wanted[0]] - load[by_load[0]] <= imbalanced_requests:
        return [wanted[0]] + [r for r in by_load if r != wanted[0]], True
    for depth in range(len(chain), 0, -1):
        owner = owners.get(chain[depth - 1])
        if owner in alive:
            if depth < match_rate * len(chain) or load[owner] - load[by_load[0]] > imbalanced_requests:
                break
            return [owner] + [r for r in by_load if r != owner], True
    return by_load, False


class PrefixRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's request router for the Decoder deployment (see the module docstring). Options
    (request_router_kwargs): block_chars, max_blocks, match_rate, imbalanced_requests, max_entries.

    The replica chosen for a request goes to that request (FIFOMixin's matching, by the request's
    own metadata): Serve's default matching by internal request id finds only the first of the
    calls one ingress request fans out (the n choices, the prompts of a list: they share the id),
    and the others would wait forever; with FIFOMixin's plain order a request could take the
    replica chosen for another's prefix."""

    def initialize_state(self, block_chars: int = 64, max_blocks: int = 256, match_rate: float = 0.1,
                         imbalanced_requests: int = 8, max_entries: int = 200_000, **unknown) -> None:
        if unknown:
            raise ValueError(f"request_router_kwargs: PrefixRouter takes block_chars, max_blocks, match_rate, "
                             f"imbalanced_requests, max_entries; not {sorted(unknown)}")
        self.block_chars, self.max_blocks, self.match_rate = block_chars, max_blocks, match_rate
        self.imbalanced_requests, self.max_entries = imbalanced_requests, max_entries
        self.owners: OrderedDict[bytes, object] = OrderedDict()  # block hash -> ReplicaID, least recent first
        self.held: dict = {}  # ReplicaID -> blocks it owns

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None

    def _chain(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or not pending_request.args:
            return []
        text = prompt_text(pending_request.args[0])
        return [] if text is None else block_chain(text, self.block_chars, self.max_blocks)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica full: wait between tries
            if pending_request.metadata.multiplexed_model_id:
                ids = self.apply_multiplex_routing(pending_request)
                candidate_replicas = [r for r in candidate_replicas if r.replica_id in ids] or candidate_replicas
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        queue_lens = {r: self._replica_queue_len_cache.get(r) for r in by_id}
        affinity = getattr(pending_request.args[0], "affinity", None) if pending_request and pending_request.args \
            else None
        order, _ = ranked(self._chain(pending_request), self.owners, list(by_id), queue_lens, self.held,
                          self.match_rate, self.imbalanced_requests, affinity)
        return [[by_id[r]] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        chain = self._chain(pending_request)
        for block in chain:
            before = self.owners.pop(block, None)
            if before is not None:
                self._count(before, -1)
            self.owners[block] = replica_id
            self._count(replica_id, 1)
        while len(self.owners) > self.max_entries:
            self._count(self.owners.popitem(last=False)[1], -1)

    def _count(self, replica_id, change: int) -> None:
        self.held[replica_id] = self.held.get(replica_id, 0) + change

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.held.pop(replica_id, None)  # its blocks are skipped (not a candidate) until overwritten or evicted
