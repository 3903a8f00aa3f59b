"""``server_config_from_args``: the ServerConfig from a Serve config file's or serve run's args."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridspec.config import ModelConfig
from hybridspec.deploy.options import server_config_from_args
from hybridspec.errors import InvalidRequestError
from hybridspec.server.config import ServerConfig


def test_no_args_are_the_defaults() -> None:
    assert server_config_from_args(None) == ServerConfig()
    assert server_config_from_args({}) == ServerConfig()


def test_nested_args_as_a_yaml_file_gives_them() -> None:
    config = server_config_from_args(
        {
            "engine": {
                "target": {"name_or_path": "/models/m", "max_num_seqs": 4},
                "draft": {"model": {"name_or_path": "/models/d"}, "cost_per_token": 0.2},
                "default_proposer": "none",
                "adaptive_speculation": False,
            },
            "served_model_name": "m",
            "max_prompt_tokens": None,
        }
    )
    assert config.engine.target == ModelConfig("/models/m", max_num_seqs=4)
    assert config.engine.draft.model == ModelConfig("/models/d")
    assert config.engine.draft.cost_per_token == 0.2
    assert (config.engine.default_proposer, config.engine.adaptive_speculation) == ("none", False)
    assert config.served_model_name == "m"


def test_dotted_text_args_as_serve_run_gives_them() -> None:
    config = server_config_from_args(
        {
            "engine.target.name_or_path": "/models/m",
            "engine.target.max_num_seqs": "6",
            "engine.target.max_seq_len": "none",
            "engine.adaptive_speculation": "false",
            "engine.verify_token_cost": "0.05",
            "engine.draft.cost_per_token": "null",
            "max_body_bytes": "1000",
        }
    )
    assert config.engine.target == ModelConfig("/models/m", max_num_seqs=6)
    assert config.engine.adaptive_speculation is False
    assert config.engine.verify_token_cost == 0.05 and config.engine.draft.cost_per_token is None
    assert config.max_body_bytes == 1000


def test_dotted_and_nested_args_combine() -> None:
    config = server_config_from_args(
        {"engine": {"target": {"dtype": "float32"}}, "engine.target.max_num_seqs": 2}
    )
    assert (config.engine.target.dtype, config.engine.target.max_num_seqs) == ("float32", 2)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"engine.target.colour": "red"}, "engine.target.colour"),
        ({"engin": {}}, "engin"),
        ({"engine.target.max_num_seqs": "many"}, "engine.target.max_num_seqs"),
        ({"engine.adaptive_speculation": "perhaps"}, "engine.adaptive_speculation"),
        ({"engine.target.max_num_seqs": 0}, "max_num_seqs"),  # the config's own check
        ({"port": "80", "port.x": 1}, "port"),
    ],
)
def test_bad_args_name_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
        server_config_from_args(args)


def test_the_example_cluster_config_builds_its_server_config() -> None:
    yaml = pytest.importorskip("yaml")
    schema = pytest.importorskip("ray.serve.schema")
    from hybridspec.deploy.app import DEPLOYMENT_NAME

    path = Path(__file__).parents[2] / "examples" / "ray" / "serve_config.yaml"
    document = yaml.safe_load(path.read_text())
    schema.ServeDeploySchema.model_validate(document)  # Ray's own check of the file
    (app,) = document["applications"]
    assert app["import_path"] == "hybridspec.deploy:build_app"
    assert [d["name"] for d in app["deployments"]] == [DEPLOYMENT_NAME]
    config = server_config_from_args(app["args"])
    assert config.engine.target.name_or_path == "meta-llama/Llama-3.2-3B-Instruct"
    assert config.engine.draft.model is not None and config.engine.target.device == "cuda"
