"""Autoscaling: each deployment's bounds and targets, and the decoder's policy.

Ray Serve's default policy scales a deployment on ongoing requests per replica. For a decoder
that is the wrong signal: its capacity is its slots, a request holds one from its first token
to its last (the number of requests says nothing of how long they hold it), and the requests
that wait for a slot are the ones whose first token is late. `DecoderPolicy` (Ray 2.60's custom
policy API: `AutoscalingPolicy(policy_function=..., policy_kwargs=...)`, fed by each replica's
`record_autoscaling_stats`) asks for the replicas that hold every row wanting a slot at the
target occupancy:

    replicas = (running rows + waiting requests, summed over replicas) / (slots x target_occupancy)

e.g. 3 replicas of 8 slots, 20 rows running and 10 waiting, target 0.75: 30 / 6 = 5 replicas.
Ray wraps a custom policy with the deployment's bounds, delays and scaling factors
(`ray.serve.autoscaling_policy._apply_autoscaling_config`), so `min_replicas`, `max_replicas`,
`upscale_delay_s` and `downscale_delay_s` keep their meaning. Until a replica has reported
(its first seconds), Ray's own rule decides.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: what a Decoder replica reports (Decoder.record_autoscaling_stats)
RUNNING, WAITING, SLOTS = "raymuter_running_rows", "raymuter_waiting_requests", "raymuter_slots"
POLICY = "deployments.autoscaling:DecoderPolicy"
PARTS = ("ingress", "decoder", "encoder", "vision")
#: requests per replica Ray's default policy aims at, by part (the decoder's: about its slots)
TARGET_ONGOING = {"ingress": 128, "decoder": 8, "encoder": 16, "vision": 16}


class Autoscaling(BaseModel):
    """One deployment's autoscaling (AppConfig.autoscaling[part]; Helm deployments.<part>.autoscaling)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0, le=1024)
    max_replicas: int = Field(default=4, ge=1, le=1024)
    initial_replicas: int | None = Field(default=None, ge=0, le=1024)
    # Ray's default policy (ongoing requests per replica); the ingress, encoder and vision use it
    target_ongoing_requests: float | None = Field(default=None, gt=0)
    # the decoder: "occupancy" (DecoderPolicy: running rows and waiting requests against its
    # slots) or "ongoing" (Ray's default policy)
    policy: Literal["occupancy", "ongoing"] = "occupancy"
    target_occupancy: float = Field(default=0.75, gt=0, le=1)
    upscale_delay_s: float = Field(default=5.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    look_back_period_s: float = Field(default=5.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas {self.initial_replicas} is not within min_replicas "
                             f"{self.min_replicas} and max_replicas {self.max_replicas}")
        return self

    def serve_config(self, part: str) -> dict:
        """The deployment's `autoscaling_config` as Ray Serve takes it."""
        config = {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests or TARGET_ONGOING[part],
            "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": self.metrics_interval_s, "look_back_period_s": self.look_back_period_s,
        }
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        if part == "decoder" and self.policy == "occupancy":
            config["policy"] = {"policy_function": POLICY, "policy_kwargs": {"target_occupancy": self.target_occupancy}}
        return config


def parse_autoscale(text: str) -> tuple[str, Autoscaling]:
    """`raymuter serve --autoscale PART=MIN:MAX[,FIELD=VALUE...]` -> (part, its settings), e.g.
    decoder=1:8,target_occupancy=0.6,downscale_delay_s=30 (FIELD: any of Autoscaling's)."""
    part, _, rest = text.partition("=")
    bounds, *fields = rest.split(",")
    low, _, high = bounds.partition(":")
    if part not in PARTS or not low.isdigit() or not high.isdigit():
        raise ValueError(f"--autoscale takes PART=MIN:MAX[,FIELD=VALUE...] with PART one of {', '.join(PARTS)}, "
                         f"not {text!r}")
    settings = {}
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or name not in Autoscaling.model_fields or name in ("min_replicas", "max_replicas"):
            raise ValueError(f"--autoscale {part}: {field!r} is not FIELD=VALUE with FIELD one of "
                             f"{', '.join(f for f in Autoscaling.model_fields if 'replicas' not in f or f == 'initial_replicas')}")
        settings[name] = value
    return part, Autoscaling(min_replicas=int(low), max_replicas=int(high), **settings)


class DecoderPolicy:
    """Ray Serve custom autoscaling policy for the Decoder deployment (see the module docstring)."""

    def __init__(self, target_occupancy: float = 0.75):
        if not 0 < target_occupancy <= 1:
            raise ValueError(f"target_occupancy must be in (0, 1], not {target_occupancy!r}")
        self.target_occupancy = target_occupancy

    def __call__(self, ctx) -> tuple[float, dict]:
        metrics = ctx.aggregated_metrics or {}
        slots = metrics.get(SLOTS) or {}
        if not slots:  # no replica has reported yet
            from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

            return replica_queue_length_autoscaling_policy(ctx)
        return desired_replicas(metrics.get(RUNNING, {}), metrics.get(WAITING, {}), slots, self.target_occupancy), {}


def desired_replicas(running: dict, waiting: dict, slots: dict, target_occupancy: float) -> float:
    """Replicas whose slots hold every running row and waiting request at `target_occupancy`
    (dicts: replica -> its reported value, averaged over Ray's look-back window)."""
    per_replica = sum(slots.values()) / len(slots) * target_occupancy
    return (sum(running.values()) + sum(waiting.values())) / per_replica
