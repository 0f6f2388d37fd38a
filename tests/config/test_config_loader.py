"""Loading files: YAML problems, environment overrides, error lines, `llmgw config check`, shipped files."""

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import llmgw.config
from llmgw.config import ConfigError, load_config
from llmgw.config.check import check_file, run

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """\
models:
  - name: m1
    aliases: [one]
providers:
  - id: p
    kind: managed
    models: [{name: m1}]
endpoints:
  - id: e
    url: http://127.0.0.1:8101
    provider: p
    models: [m1]
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_lines(path, env=None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, env=env if env is not None else {})
    return str(caught.value).splitlines()


def test_loads_a_minimal_file(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), env={})
    assert config.public_model_ids() == ["m1", "one"]
    assert config.endpoint("e").provider == "p"


def test_environment_overrides_win_over_the_file_case_insensitively(tmp_path):
    path = write(
        tmp_path, MINIMAL + "router:\n  retries: 1\n  cooldown: 5s\nadmission:\n  enabled: true\n"
    )
    env = {
        "LLMGW_ROUTER__RETRIES": "3",
        "llmgw_nats__url": "nats://10.0.0.1:4222,nats://10.0.0.2:4222",
        "LLMGW_ADMISSION__ENABLED": "false",
        "LLMGW_TIMEOUTS__TOTAL": "1h",
        "LLMGW_NOT_A_FIELD": "ignored",
        "OTHER": "ignored",
    }
    config = load_config(path, env=env)
    assert config.router.retries == 3
    assert config.router.cooldown == 5.0  # untouched file value survives the nested merge
    assert config.nats.servers == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
    assert config.admission.enabled is False
    assert config.timeouts.total == 3600.0


def test_explicit_env_replaces_the_process_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_ROUTER__RETRIES", "7")
    path = write(tmp_path, MINIMAL)
    assert load_config(path, env={}).router.retries == 2
    assert load_config(path).router.retries == 7


def test_errors_are_file_prefixed_lines_that_name_the_field_and_the_env_var(tmp_path):
    path = write(tmp_path, MINIMAL + "router:\n  retries: -1\n")
    lines = error_lines(path, env={"LLMGW_SCORING__KV_CEILING": "2"})
    assert f"{path}: router.retries: Input should be greater than or equal to 0 (got -1)" in lines
    assert any(
        line.startswith(f"{path}: scoring.kv_ceiling: ")
        and "(from LLMGW_SCORING__KV_CEILING)" in line
        for line in lines
    ), lines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "empty file"),
        ("# only a comment\n", "empty file"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("models: [\n", "line 2"),
        ("a: b\n  c: d\n", "line 2"),
    ],
    ids=["empty", "comment-only", "list", "unclosed-flow", "bad-indent"],
)
def test_unusable_files_get_one_clear_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    lines = error_lines(path)
    assert len(lines) == 1 and lines[0].startswith(f"{path}: ") and expected in lines[0], lines


def test_missing_file_and_missing_path(tmp_path):
    assert error_lines(tmp_path / "absent.yaml") == [f"{tmp_path / 'absent.yaml'}: no such file"]
    with pytest.raises(ConfigError, match="no config file given"):
        load_config(None)


def test_private_looking_keys_are_rejected_not_passed_to_settings(tmp_path):
    path = write(tmp_path, MINIMAL + "_env_file: .env\n")
    assert error_lines(path) == [f"{path}: _env_file: unknown field"]


def test_check_prints_effective_config_with_strings_and_masked_secrets(tmp_path):
    path = write(tmp_path, MINIMAL + "nats:\n  url: nats://h:4222\n  password: hunter2\n")
    out, err = io.StringIO(), io.StringIO()
    env = {"LLMGW_NATS__TOKEN": "tok", "LLMGW_BALANCER__GREEDINESS": "0.1"}
    code = check_file(str(path), env=env, stdout=out, stderr=err)
    assert code == 0
    dumped = yaml.safe_load(out.getvalue())
    assert dumped["nats"]["password"] == "***" and dumped["nats"]["token"] == "***"
    assert "hunter2" not in out.getvalue() and "tok\n" not in out.getvalue()
    assert dumped["timeouts"]["total"] == "30m" and dumped["admission"]["interval"] == "10ms"
    assert "round-robin" in err.getvalue()
    # The dump is itself a valid config, equal to the original once the masked secrets are dropped.
    del dumped["nats"]["password"], dumped["nats"]["token"]
    dumped["balancer"]["greediness"] = 0.5
    secrets = {"nats": {"password", "token"}}
    assert llmgw.config.config_from_dict(dumped, env={}).model_dump(exclude=secrets) == load_config(
        path, env={}
    ).model_dump(exclude=secrets)


def test_check_reports_errors_on_stderr_with_exit_code_2(tmp_path):
    path = write(tmp_path, MINIMAL.replace("provider: p", "provider: q"))
    out, err = io.StringIO(), io.StringIO()
    assert check_file(str(path), env={}, stdout=out, stderr=err) == 2
    assert out.getvalue() == ""
    assert (
        f"{path}: endpoints[0].provider: unknown provider 'q'; known providers: p\n"
        in err.getvalue()
    )


def test_a_provider_model_no_endpoint_of_the_file_serves_is_a_warning_not_an_error(tmp_path):
    """Engines may join the live fleet later (added, registered, discovered, an adapter
    loaded): the file is valid, and `llmgw config check` says what no endpoint serves yet."""
    unserved = MINIMAL.replace("models: [{name: m1}]", "models: [{name: m1}, {name: m2}]")
    unserved = unserved.replace("    aliases: [one]\n", "    aliases: [one]\n  - name: m2\n")
    path = write(tmp_path, unserved)
    out, err = io.StringIO(), io.StringIO()
    assert check_file(str(path), env={}, stdout=out, stderr=err) == 0
    assert err.getvalue() == (
        f"{path}: warning: providers[0].models[1].name: no endpoint in this file serves model "
        "'m2' of provider 'p': it is served once an endpoint that serves it joins the live fleet\n"
    )
    # Kubernetes discovery brings the provider's engines in: none in the file is expected.
    discovered = unserved.replace("endpoints:\n  - id: e", "endpoints:\n  - id: e\n", 1)
    discovered = unserved.split("endpoints:")[0] + (
        "endpoints: []\nfleet:\n  kubernetes: {service: vllm, provider: p}\n"
    )
    out, err = io.StringIO(), io.StringIO()
    assert (
        check_file(str(write(tmp_path, discovered, "k8s.yaml")), env={}, stdout=out, stderr=err)
        == 0
    )
    assert err.getvalue() == ""


def test_check_command_line(tmp_path):
    good = subprocess.run(
        [sys.executable, "-m", "llmgw", "config", "check", str(write(tmp_path, MINIMAL))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert good.returncode == 0, good.stderr
    assert yaml.safe_load(good.stdout)["endpoints"][0]["id"] == "e"
    bad = subprocess.run(
        [sys.executable, "-m", "llmgw", "config", "check", str(tmp_path / "none.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.strip().endswith("none.yaml: no such file")


def test_run_takes_the_parsed_namespace(tmp_path, capsys):
    class Args:
        file = str(write(tmp_path, MINIMAL))

    assert run(Args()) == 0
    assert "effective configuration" in capsys.readouterr().out


def test_public_api_is_exactly_all():
    exported = {name for name in dir(llmgw.config) if not name.startswith("_")}
    submodules = {
        "addresses",
        "catalog",
        "credentials",
        "check",
        "common",
        "durations",
        "fleet",
        "loader",
        "observability",
        "references",
        "schema",
        "sections",
        "simulate",
        "spend",
    }
    assert exported - submodules == set(llmgw.config.__all__)
    for name in (
        "load_config",
        "config_from_dict",
        "Config",
        "ConfigError",
        "parse_duration",
        "format_duration",
        "parse_hostport",
    ):
        assert name in llmgw.config.__all__


def test_local_yaml_is_the_documented_local_cluster():
    pytest.importorskip("llmgw.services.sim.params")
    config = load_config(REPO / "config" / "local.yaml", env={})
    assert (config.listen, config.admin_listen) == ("127.0.0.1:8080", "127.0.0.1:9090")
    assert config.nats.is_embedded and config.nats.embedded_port == 4222
    assert config.public_model_ids() == ["llama-3.3-70b", "llama", "qwen2.5-32b", "qwen"]
    assert config.model("llama").fallbacks == ["qwen2.5-32b"]
    assert [p.id for p in config.providers_in_priority_order()] == ["iris", "tensorx"]
    iris = config.provider("iris")
    assert all("embeddings" in m.features and m.limits is not None for m in iris.models)
    by_id = {e.id: e for e in config.endpoints}
    assert {i: (e.port, e.provider, e.simulate.kind) for i, e in by_id.items()} == {
        "engine-1": (8101, "iris", "engine"),
        "engine-2": (8102, "iris", "engine"),
        "tensorx-east": (8201, "tensorx", "provider"),
        "tensorx-west": (8202, "tensorx", "provider"),
    }
    assert (
        by_id["tensorx-east"].simulate.tokens_per_second
        != by_id["tensorx-west"].simulate.tokens_per_second
    )


def test_example_yaml_validates_and_sets_every_top_level_section():
    pytest.importorskip("llmgw.services.sim.params")
    path = REPO / "config" / "example.yaml"
    raw = yaml.safe_load(path.read_text())
    assert set(raw) == set(llmgw.config.Config.model_fields)
    load_config(path, env={})


def test_a_whole_section_from_the_environment_must_be_json(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert load_config(path, env={"LLMGW_ROUTER": '{"retries": 5}'}).router.retries == 5
    assert error_lines(path, env={"LLMGW_NATS": "nats://h:4222"}) == [
        f"{path}: nats: LLMGW_NATS is not valid JSON (a section or list needs JSON)"
    ]
