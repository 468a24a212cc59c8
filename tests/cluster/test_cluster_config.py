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
    assert {d.name for d in app.deployments} <= names == {"Ingress", "Decoder", "Records"}


def test_bad_app_arguments_fail_with_the_field():
    from pydantic import ValidationError

    from deployments.app import AppConfig

    with pytest.raises(ValidationError, match="slots"):
        AppConfig(slots=-1)
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


def test_the_engine_options_are_written_once_and_the_config_flags_and_chart_schema_are_made_from_them():
    """EngineOptions' fields (generation/front/options.py) give AppConfig's engine fields, the CLI's
    engine flags and the Helm chart's values schema: the same names, a server's defaults and help."""
    import argparse
    from dataclasses import fields

    from cluster.render import args_schema
    from deployments.app import AppConfig
    from deployments.cli.arguments import add_engine_arguments
    from deployments.config import ServingConfig
    from generation.front import EngineOptions

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {a.dest: a for a in parser._actions}
    schema = args_schema()["properties"]
    served = [f for f in fields(EngineOptions) if f.metadata["serve"]]
    assert len(served) >= 18 and not set(ServingConfig.model_fields) & {f.name for f in served}  # not copied
    for option in served:
        meta, field = option.metadata, AppConfig.model_fields[option.name]
        assert meta["help"] and field.description == meta["help"], option.name
        assert (AppConfig().model_dump()[option.name] or None) == (meta["served"] or None), option.name
        assert schema[option.name]["description"] == meta["help"], option.name
        if meta["flag"]:
            flag = flags[option.name]
            assert flag.default == meta["served"], option.name
            assert flag.help.startswith(meta["off"] if meta["served"] is True else meta["help"]), option.name
            assert flag.option_strings == ["--" + ("no-" if meta["served"] is True else "") +
                                           option.name.replace("_", "-")], option.name
    assert AppConfig().slots == 0 and EngineOptions().slots == 8  # a server's default beside a library caller's
    # decoder autoscaling by occupancy counts rows against a replica's slots: slots=0 gives 32 there
    assert AppConfig(autoscaling={"decoder": {"min_replicas": 1, "max_replicas": 2}}).slots == 32
    assert AppConfig(slots=64, autoscaling={"decoder": {"min_replicas": 1, "max_replicas": 2}}).slots == 64
    assert AppConfig(slots=4, spin=False).options == EngineOptions(slots=4, spin=False, prefix_cache_bytes=256 * 2**20,
                                                                   grammar_budget={}, lora_modules={})


@pytest.mark.parametrize("values, message", [
    ({"slots": -1}, "slots: an integer from 0 to 1024"), ({"max_logprobs": 21}, "max_logprobs: an integer from -1"),
    ({"provider": "tpu"}, "provider: one of cpu, cuda"), ({"reasoning_parser": "x"}, "reasoning_parser: one of"),
    ({"reserve_cores": 1}, "they need engine_process"), ({"kv_cache_bytes": -1}, "kv_cache_bytes: an integer"),
])
def test_an_engine_option_out_of_range_is_refused_by_name(values, message):
    """The engine's options check themselves (a library caller's EngineOptions too), and a Serve
    config's AppConfig refuses the same values naming the field."""
    from pydantic import ValidationError

    from deployments.app import AppConfig
    from generation.front import EngineOptions

    with pytest.raises(ValueError, match=message):
        EngineOptions(**values)
    with pytest.raises(ValidationError, match=next(iter(values))):
        AppConfig(**values)
