"""helm/raymuter: lint, render, validate offline (tests/cluster/k8s.py), the rendered application equal
to the one `raymuter serve` builds, and wrong values refused naming the field."""

from __future__ import annotations

import argparse
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from k8s import crd_schemas, helm_binary, validation_errors

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "raymuter"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))


@pytest.fixture(scope="session")
def helm():
    return helm_binary()


@pytest.fixture(scope="session")
def crds():
    return crd_schemas()


def run_helm(helm, *args, values: dict | None = None, tmp_path: Path | None = None):
    extra = []
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["-f", str(path)]
    return subprocess.run([str(helm), *args, *extra], capture_output=True, text=True, timeout=120)


def values_flags(files: tuple) -> list[str]:
    return [flag for f in files for flag in ("-f", str(f))]


def render(helm, tmp_path, values: dict | None = None, files: tuple = ()) -> list[dict]:
    args = ["template", "r1", str(CHART), *values_flags(files)]
    out = run_helm(helm, *args, values=values, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def serve_config(docs: list[dict]) -> dict:
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def test_the_chart_examples_are_listed():
    assert {p.stem for p in EXAMPLES} == {"cpu-only", "gpu-decoder", "autoscaling"}


@pytest.mark.parametrize("example", [None] + EXAMPLES, ids=lambda p: "defaults" if p is None else p.stem)
def test_lint_strict_render_and_validate(helm, crds, tmp_path, example):
    files = () if example is None else (example,)
    lint = subprocess.run([str(helm), "lint", "--strict", str(CHART), *values_flags(files)],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(helm, tmp_path, files=files)
    kinds = sorted(d["kind"] for d in docs)
    assert "RayService" in kinds and "Service" in kinds
    assert validation_errors(docs, crds) == []
    if example is not None and example.stem == "cpu-only":
        assert {"Ingress", "ServiceMonitor", "PodMonitor"} <= set(kinds)


def test_the_validators_catch_planted_mistakes(helm, crds, tmp_path):
    """The checks above can fail: a wrong field in each kind of document is reported."""
    docs = render(helm, tmp_path, files=(CHART / "examples" / "cpu-only.yaml",))
    by_kind = {d["kind"]: d for d in docs}
    by_kind["Service"]["spec"]["portz"] = []
    by_kind["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"] = "not a map"
    config = yaml.safe_load(by_kind["RayService"]["spec"]["serveConfigV2"])
    config["applications"][0]["deployments"][0]["num_replicas"] = "two"
    by_kind["RayService"]["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["interval"] = 30
    errors = "\n".join(validation_errors(list(by_kind.values()), crds))
    assert "portz" in errors and "rayStartParams" in errors and "num_replicas" in errors
    assert "ServiceMonitor" in errors and "interval" in errors


def test_generated_parts_are_up_to_date():
    """files/deployments.json and values.schema.json's app.args come from the code (cluster.render)."""
    from cluster.render import main

    assert main(["--check"]) == 0, "run `python -m cluster.render`"


def _cli_config(*argv: str) -> dict:
    from deployments.cli.serve import add_arguments, app_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return app_config(parser.parse_args(list(argv)))


@pytest.mark.parametrize("kind,fixture", [("text", "llama-genai"), ("encoder-decoder", "marian-optimum"),
                                          ("vision", "qwen2vl-onnx")])
def test_the_rendered_application_is_the_one_raymuter_serve_builds(helm, tmp_path, test_models, s2s,
                                                                   vision_paths, kind, fixture):
    """The same model folder and settings through `raymuter serve`'s arguments and through the
    chart's values give the same Serve application: arguments, deployments and their options."""
    from deployments.app import AppConfig, build
    from cluster.render import serve_application

    folder = str({**test_models, **s2s, **vision_paths}[fixture])
    from deployments.services.routing import ROUTERS

    deployments = {"decoder": {"replicas": 2, "cpus": 1.5, "memoryMiB": 2048, "router": "round_robin"}, "ingress": {
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetOngoingRequests": 64}}}
    serve_options = {"Decoder": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1.5, "memory": 2048 * 2**20},
                                 "request_router_config": {"request_router_class": ROUTERS["round_robin"]}},
                     "Ingress": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3,
                                                        "target_ongoing_requests": 64}}}
    if kind != "text":
        part = "encoder" if kind == "encoder-decoder" else "vision"
        deployments[part] = {"replicas": 3, "cpus": 2}
        serve_options[part.capitalize()] = {"num_replicas": 3, "ray_actor_options": {"num_cpus": 2}}
    values = {"model": {"kind": kind, "source": "hostPath", "hostPath": {"path": folder}},
              "app": {"args": {"slots": 4, "max_waiting": 32, "max_logprobs": 3, "settings": {"max_new_tokens": 20}}},
              "deployments": deployments}
    config = serve_config(render(helm, tmp_path, values))
    assert config["proxy_location"] == "EveryNode" and config["http_options"]["port"] == 8000
    (app,) = config["applications"]

    # the chart's layout (an Ingress and a Decoder): `raymuter serve --split` (its default for a
    # decoder-only text model is --colocate --engine-process)
    cli = _cli_config("--model", folder, "--split", "--slots", "4", "--max-waiting", "32", "--max-logprobs", "3",
                      "--set", "max_new_tokens=20", "--api-key", "")
    cli["api_key"] = None  # the chart passes the key from a Secret, as RAYMUTER_API_KEY
    expected = serve_application(cli, serve_options)
    # the pod sees the host folder at /models; the model id clients send is still the folder's name
    assert app["args"]["model"] == "/models" and app["args"]["name"] == Path(folder).name
    assert AppConfig(**{**app["args"], "model": folder}).model_dump() == AppConfig(
        **{**cli, "name": Path(folder).name, "kind": kind}).model_dump()
    assert app["import_path"] == expected["import_path"] and app["name"] == expected["name"]
    assert app["route_prefix"] == expected["route_prefix"]
    code_defaults = {d["name"]: d for d in expected["deployments"]}
    rendered = {d["name"]: d for d in app["deployments"]}
    assert list(rendered) == list(code_defaults)  # the same deployments, the ingress first
    for name, entry in code_defaults.items():  # the code's options, updated by the same settings
        assert rendered[name] == entry, (name, rendered[name], entry)
    # the folder builds that application with the chart's arguments
    built = build({**app["args"], "model": folder})
    assert built._bound_deployment.name == "Ingress"


def test_a_colocated_application_renders_as_raymuter_serve_colocate_builds_it(helm, tmp_path, test_models):
    """app.args.colocate: one Server deployment (routes and decoder) in place of Ingress and
    Decoder, taking deployments.decoder's replicas, resources and autoscaling policy."""
    from cluster.render import serve_application
    from deployments.app import ROUTER_ON_LOOP, build

    folder = str(test_models["llama-genai"])
    values = {"model": {"kind": "text", "source": "hostPath", "hostPath": {"path": folder}},
              "app": {"args": {"colocate": True}},
              "deployments": {"decoder": {"cpus": 1.5, "autoscaling": {
                  "enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetOngoingRequests": 8}}}}
    (app,) = serve_config(render(helm, tmp_path, values))["applications"]
    server, records = app["deployments"]
    assert server["name"] == "Server" and app["args"]["colocate"] is True
    assert records["name"] == "Records" and records["num_replicas"] == 1  # the responses, files and batches: one, shared
    assert server["ray_actor_options"] == {"num_cpus": 1.5, "runtime_env": {"env_vars": ROUTER_ON_LOOP}}
    assert server["autoscaling_config"]["policy"]["policy_function"] == "deployments.autoscaling:DecoderPolicy"
    assert "request_router_config" not in server  # HTTP reaches it through the proxy, not a handle's router
    cli = _cli_config("--model", folder, "--colocate")
    expected, *_ = serve_application(cli, {"Server": {"ray_actor_options": server["ray_actor_options"],
                                                      "autoscaling_config": server["autoscaling_config"]}})["deployments"]
    assert server == expected
    assert build({**app["args"], "model": folder})._bound_deployment.name == "Server"
    # records "server" (`raymuter serve`'s default with one Server replica): no Records deployment
    values = {**values, "app": {"args": {"colocate": True, "records": "server"}}, "deployments": {}}
    (app,) = serve_config(render(helm, tmp_path, values))["applications"]
    assert [d["name"] for d in app["deployments"]] == ["Server"]
    assert cli["records"] == "server" and [d["name"] for d in serve_application(cli)["deployments"]] == ["Server"]


BAD = [
    ({"deployments": {"decoder": {"replicas": -1}}}, "/deployments/decoder/replicas"),
    ({"deployments": {"decodr": {"replicas": 1}}}, "decodr"),
    ({"deployments": {"decoder": {"router": "random"}}}, "/deployments/decoder/router"),
    ({"workers": {"cpu": {"enabled": True, "gpus": 1}}}, "gpus"),
    ({"deployments": {"decoder": {"gpus": 1}}}, "/workers/gpu/enabled"),
    ({"model": {"kind": "audio", "source": "bundled"}}, "/model/kind"),
    ({"model": {"kind": "text", "source": "hub", "hub": {"id": ""}}}, "/model/hub/id"),
    ({"app": {"args": {"slots": -1}}}, "/app/args/slots"),
    ({"app": {"args": {"slotz": 4}}}, "slotz"),
    ({"workers": {"cpu": {"enabled": True, "resources": {"cpu": "4", "memory": "lots"}}}}, "/workers/cpu/resources/memory"),
]


@pytest.mark.parametrize("values,field", BAD, ids=[b[1] for b in BAD])
def test_wrong_values_are_refused_naming_the_field(helm, tmp_path, values, field):
    out = run_helm(helm, "template", "r1", str(CHART), values=values, tmp_path=tmp_path)
    assert out.returncode != 0, f"accepted: {values}"
    assert "values don't meet the specifications of the schema" in out.stderr or "schema" in out.stderr, out.stderr
    assert field in out.stderr, out.stderr


def test_the_image_and_the_chart_run_the_ray_the_project_pins():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (ray_pin,) = [p for p in pins if p.startswith("ray[") and "==" in p]
    version = ray_pin.split("==")[1]
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_VERSION={re.escape(version)}$", dockerfile, re.M), "cluster/Dockerfile's Ray"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["ray"]["version"] == version == chart["annotations"]["raymuter.io/ray-version"]
    assert chart["appVersion"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("policy", ["occupancy", "ongoing"])
def test_the_decoder_autoscales_on_its_occupancy_by_default(helm, tmp_path, policy):
    """The chart's decoder autoscaling names deployments.autoscaling.DecoderPolicy (unless
    policy: ongoing), in the form Serve takes; the other parts keep Ray's default policy."""
    from ray.serve.config import AutoscalingConfig

    from deployments.autoscaling import POLICY

    scaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetOngoingRequests": 8, "policy": policy,
               "targetOccupancy": 0.6, "upscaleDelayS": 5, "downscaleDelayS": 60}
    values = {"deployments": {"decoder": {"autoscaling": scaling},
                              "ingress": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                                          "targetOngoingRequests": 64}}}}
    (app,) = serve_config(render(helm, tmp_path, values))["applications"]
    entries = {d["name"]: d for d in app["deployments"]}
    decoder = entries["Decoder"]["autoscaling_config"]
    if policy == "occupancy":
        assert decoder["policy"] == {"policy_function": POLICY, "policy_kwargs": {"target_occupancy": 0.6}}
        from ray.serve._private.autoscaling_state import _resolve_policy_callable

        assert _resolve_policy_callable(AutoscalingConfig(**decoder).policy).target_occupancy == 0.6  # as Serve builds it
    else:
        assert "policy" not in decoder
    assert (decoder["min_replicas"], decoder["max_replicas"], decoder["downscale_delay_s"]) == (1, 3, 60)
    assert "policy" not in entries["Ingress"]["autoscaling_config"]


def test_pods_drain_longer_than_their_replicas_and_leave_one_at_a_time(helm, tmp_path):
    from deployments.app import DRAIN_SECONDS

    docs = render(helm, tmp_path)
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchExpressions"] == [{"key": "raymuter.io/group", "operator": "In",
                                                             "values": ["cpu", "gpu"]}]
    (service,) = [d for d in docs if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert all(p["spec"]["terminationGracePeriodSeconds"] > DRAIN_SECONDS for p in pods)
    assert all(p["metadata"]["labels"]["raymuter.io/group"] in ("cpu", "gpu")
               for p in pods[1:])  # what the budget selects
    off = render(helm, tmp_path, {"drain": {"podDisruptionBudget": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget"]
