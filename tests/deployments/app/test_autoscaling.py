"""Autoscaling (deployments/autoscaling.py): each deployment's settings, and the decoder's policy.

Invariants: the decoder policy asks for the replicas whose slots hold every running row and
waiting request at the target occupancy, and Ray's own rule until a replica has reported; the
settings refuse bounds that contradict each other, naming them; `raymuter serve --autoscale`,
AppConfig and the Helm values give Serve the same autoscaling_config; under a burst the decoder
grows to its maximum, every request gets its whole answer, and it shrinks back when the burst is
over (its replicas drained, no stream cut).
"""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import pytest

from deployments import autoscaling
from deployments.autoscaling import RUNNING, SLOTS, WAITING, Autoscaling, DecoderPolicy, desired_replicas


def test_the_docstring_example():
    replicas = {"a": 0, "b": 0, "c": 0}
    running = dict(zip(replicas, [8, 8, 4]))
    waiting = dict(zip(replicas, [6, 4, 0]))
    assert desired_replicas(running, waiting, dict.fromkeys(replicas, 8), 0.75) == 5


def test_the_policy_reads_what_replicas_report():
    policy = DecoderPolicy(target_occupancy=0.5)
    ctx = SimpleNamespace(aggregated_metrics={RUNNING: {"a": 4.0, "b": 3.0}, WAITING: {"a": 5.0, "b": 0.0},
                                              SLOTS: {"a": 4.0, "b": 4.0}})
    assert policy(ctx) == (6.0, {})
    ctx.aggregated_metrics = {RUNNING: {"a": 0.0, "b": 0.0}, WAITING: {"a": 0.0, "b": 0.0}, SLOTS: {"a": 4.0, "b": 4.0}}
    assert policy(ctx) == (0.0, {})  # Ray applies min_replicas and the downscale delay


def test_before_any_report_ray_s_own_rule_decides(monkeypatch):
    import ray.serve.autoscaling_policy as ray_policy

    monkeypatch.setattr(ray_policy, "replica_queue_length_autoscaling_policy", lambda ctx: (3, {"ray": 1}))
    assert DecoderPolicy()(SimpleNamespace(aggregated_metrics={})) == (3, {"ray": 1})
    assert DecoderPolicy()(SimpleNamespace(aggregated_metrics=None)) == (3, {"ray": 1})


@pytest.mark.parametrize("settings, message", [
    (dict(min_replicas=5, max_replicas=2), "min_replicas 5 is above max_replicas 2"),
    (dict(min_replicas=1, max_replicas=4, initial_replicas=6), "initial_replicas 6 is not within"),
    (dict(target_occupancy=1.5), "less than or equal to 1"),
    (dict(policy="queue"), "'occupancy' or 'ongoing'"),
    (dict(max_replicas=4, replicas=2), "Extra inputs are not permitted"),
])
def test_contradicting_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        Autoscaling(**settings)
    with pytest.raises(ValueError, match="target_occupancy must be in"):
        DecoderPolicy(target_occupancy=0)


def test_each_part_gets_serve_s_autoscaling_config():
    decoder = Autoscaling(min_replicas=1, max_replicas=8, target_occupancy=0.6).serve_config("decoder")
    assert decoder["policy"] == {"policy_function": autoscaling.POLICY, "policy_kwargs": {"target_occupancy": 0.6}}
    assert (decoder["min_replicas"], decoder["max_replicas"], decoder["target_ongoing_requests"]) == (1, 8, 8)
    ingress = Autoscaling(max_replicas=2).serve_config("ingress")
    assert "policy" not in ingress and ingress["target_ongoing_requests"] == 128
    assert "policy" not in Autoscaling(policy="ongoing").serve_config("decoder")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.config import AutoscalingConfig

    assert _resolve_policy_callable(AutoscalingConfig(**decoder).policy).target_occupancy == 0.6  # as Serve builds it


def test_raymuter_serve_autoscale_flags():
    from deployments import cli
    from deployments.cli import serve as serving
    from deployments.app import AppConfig

    args = cli.parser().parse_args(["serve", "--autoscale", "decoder=1:6", "--autoscale", "ingress=1:2"])
    cfg = AppConfig(**serving.app_config(args))
    assert (cfg.autoscaling["decoder"].min_replicas, cfg.autoscaling["decoder"].max_replicas) == (1, 6)
    assert cfg.autoscaling["ingress"].max_replicas == 2
    for bad in ("decoder=6:1", "router=1:2", "decoder=1"):
        with pytest.raises(ValueError, match="max_replicas|PART=MIN:MAX"):
            serving.app_config(cli.parser().parse_args(["serve", "--autoscale", bad]))
    args = cli.parser().parse_args(["serve", "--autoscale", "decoder=2:6,target_occupancy=0.6,downscale_delay_s=30,"
                                    "policy=ongoing"])
    decoder = AppConfig(**serving.app_config(args)).autoscaling["decoder"]
    assert (decoder.min_replicas, decoder.target_occupancy, decoder.downscale_delay_s, decoder.policy) == \
        (2, 0.6, 30.0, "ongoing")
    for bad, message in (("decoder=1:2,occupancy=0.5", "'occupancy=0.5' is not FIELD=VALUE"),
                         ("decoder=1:2,max_replicas=3", "is not FIELD=VALUE"),
                         ("decoder=1:2,target_occupancy=2", "less than or equal to 1")):
        with pytest.raises(ValueError, match=message):
            serving.app_config(cli.parser().parse_args(["serve", "--autoscale", bad]))


def test_the_application_carries_the_autoscaling_config():
    from ray.serve._private.build_app import build_app

    from deployments.app import AppConfig, application

    cfg = AppConfig(engine="fake", gpu="no", autoscaling={"decoder": {"max_replicas": 3}, "ingress": {"max_replicas": 2}})
    built = {d.name: d for d in build_app(application(cfg, "text"), name="scaled").deployments}
    decoder = built["Decoder"]._deployment_config.autoscaling_config
    assert decoder.max_replicas == 3 and decoder.policy.policy_function == autoscaling.POLICY
    assert built["Ingress"]._deployment_config.autoscaling_config.max_replicas == 2


def _replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def test_a_burst_grows_the_decoder_and_every_request_is_answered_whole(serve_apps):
    """The fake engine (2 slots, 20 ms a step, 45 tokens a request: 24 requests are ~11 s of work
    for one replica): requests wait for slots, and the burst is kept at 24 requests in flight
    until the decoder has grown to its 3 replicas (or two minutes pass: a busy controller, at the
    session's start on 2 cores, decided only after a first burst of 24 had ended); each request gets
    exactly its known tokens; once the burst is over it shrinks to 1 again, its replicas drained."""
    from ray import serve

    from deployments.app import build
    from deployments.fake import fake_tokens
    from deployments.schema import GenerateRequest

    scaling = dict(min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=2, metrics_interval_s=0.2,
                   look_back_period_s=0.5)
    handle = serve.run(build(dict(engine="fake", name="fake", slots=2, step_seconds=0.02, gpu="no",
                                  autoscaling={"decoder": scaling})), name="scaled", route_prefix="/scaled")
    try:
        assert _replicas("scaled", "Decoder") == 1
        settings = {"max_new_tokens": 45}

        def one(prompt):
            return handle.generate.remote(GenerateRequest(prompt=prompt, settings=settings)).result(timeout_s=120)

        peak, prompts, futures = 1, [], []
        keep_until = time.time() + 120
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            while True:
                while peak < 3 and time.time() < keep_until and sum(not f.done() for f in futures) < 24:
                    prompts.append(f"burst {len(prompts):03d}")
                    futures.append(pool.submit(one, prompts[-1]))
                if all(f.done() for f in futures):
                    break
                peak = max(peak, _replicas("scaled", "Decoder"))
                time.sleep(0.2)
            results = [f.result() for f in futures]
        assert peak == 3
        for prompt, out in zip(prompts, results):
            assert out.finish_reason == "length", out.error
            assert out.token_ids == fake_tokens([ord(c) for c in prompt], 0, settings)
        deadline = time.time() + 60
        while _replicas("scaled", "Decoder") > 1 and time.time() < deadline:
            time.sleep(0.5)
        assert _replicas("scaled", "Decoder") == 1
    finally:
        serve.delete("scaled", _blocking=False)


def test_a_replica_seating_by_its_budget_reports_32_slots_to_the_occupancy_policy(test_models):
    """slots 0 seats what the KV budget holds (256 slots on the in_place cache), but a replica's
    share of the work under DecoderPolicy stays 32 slots, wherever its autoscaling is configured
    (a Serve config's autoscaling_config never reaches AppConfig); given slots are reported as
    they are."""
    from deployments.autoscaling import SLOTS
    from deployments.replicas import Decoder

    for slots, seated, reported in [(0, 256, 32), (6, 6, 6)]:
        replica = Decoder({"model": str(test_models["llama-genai"]), "slots": slots, "gpu": "no"})
        try:
            assert replica.generator.batcher.slots == seated
            assert replica.record_autoscaling_stats()[SLOTS] == reported
        finally:
            replica.generator.close()
