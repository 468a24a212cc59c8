"""cluster/serve.yaml is a valid Serve config whose application builds, with the deployments the
code defines (a renamed deployment or a bad argument fails here, not on a cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[2] / "cluster" / "serve.yaml"


def test_serve_yaml_validates_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import AppConfig, build

    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build"
    AppConfig(**app.args)
    built = build(app.args)
    names = {d.name for d in [built._bound_deployment] + [a._bound_deployment for a in built._bound_deployment.init_args
                                                           if hasattr(a, "_bound_deployment")]}
    assert {d.name for d in app.deployments} <= names == {"Ingress", "Decoder", "Responses", "Batches"}


def test_bad_app_arguments_fail_with_the_field():
    from pydantic import ValidationError

    from deployments.app import AppConfig

    with pytest.raises(ValidationError, match="slots"):
        AppConfig(slots=0)
    with pytest.raises(ValidationError, match="modle"):
        AppConfig(modle="x")


def test_a_kind_that_is_not_the_models_is_refused_naming_it(test_models, s2s):
    """The chart names the deployments (kind); the application checks the folder holds that kind."""
    from deployments.app import PARTS, build

    with pytest.raises(ValueError, match="kind: 'encoder-decoder' was given, but the model .* is 'text'"):
        build({"model": str(test_models["llama-genai"]), "kind": "encoder-decoder"})
    app = build({"model": str(s2s["marian-optimum"]), "kind": "encoder-decoder"})
    bound = app._bound_deployment
    names = [bound.name] + [a._bound_deployment.name for a in bound.init_args if hasattr(a, "_bound_deployment")]
    assert sorted(names) == sorted(PARTS["encoder-decoder"])
