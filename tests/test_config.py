"""Settings: one source for the engine's and the server's configs and for the README's table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from service.config import (
    ConfigError,
    EngineConfig,
    ServerConfig,
    Settings,
    load_settings,
    resolve,
)
from service.model.families import FAMILIES, PRESETS
from service.settings_table import settings_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_case_insensitive_choices():
    s = load_settings({"LOG_LEVEL": "INFO", "DEVICE": "CPU", "DTYPE": "BFloat16"})
    assert (s.log_level, s.device, s.dtype) == ("info", "cpu", "bfloat16")


@pytest.mark.parametrize("var,value", [("LOG_LEVEL", "LOUD"), ("MEM_FRACTION_STATIC", "1.0"),
                                       ("MEM_FRACTION_STATIC", "0"), ("PAGE_SIZE", "zero")])
def test_bad_values_name_the_variable(var, value):
    with pytest.raises(ConfigError) as e:
        load_settings({var: value})
    assert var in str(e.value) and value.lower() in str(e.value).lower()


@pytest.mark.parametrize("env", [{"PORT": "9000", "ADMIN_PORT": "9000"}, {"PORT": "8001"}],
                         ids=["both-set", "port-on-the-admin-default"])
def test_admin_port_must_differ_from_port(env):
    with pytest.raises(ConfigError) as e:
        load_settings(env)
    assert "ADMIN_PORT=" in str(e.value) and "must differ from PORT" in str(e.value)
    assert load_settings({**env, "ADMIN_PORT": "0"}).admin_port == 0  # 0: no admin listener


@pytest.mark.parametrize("var", ["DP_SIZE", "TP_SIZE", "DATA_PARALLEL_SIZE",
                                 "TENSOR_PARALLEL_SIZE", "dp_size"])
def test_parallel_sizes_other_than_one_are_refused(var):
    """One engine per pod: DP_SIZE=2 and its vLLM/SGLang kin stop start-up instead of being
    ignored; 1 is what the service does anyway."""
    with pytest.raises(ConfigError) as e:
        load_settings({var: "2"})
    assert f"{var.upper()}='2'" in str(e.value) and "scales out with replicas" in str(e.value)
    assert load_settings({var: "1"}) == load_settings({})


def test_every_config_field_is_a_setting_and_every_setting_reaches_a_config():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    assert engine | server == set(Settings.model_fields) and not engine & server


@pytest.mark.parametrize("cls", [EngineConfig, ServerConfig])
def test_config_defaults_are_the_settings_defaults(cls):
    """Defaults are written once, in Settings; fields resolved from "auto" or the host have none."""
    resolved = {"device", "dtype", "served_model_name", "api_workers"}
    for f in dataclasses.fields(cls):
        if f.name in resolved:
            assert f.default is dataclasses.MISSING, f.name
        else:
            assert f.default == Settings.model_fields[f.name].default, f.name


def test_values_come_from_the_settings_by_name():
    env = {"PAGE_SIZE": "32", "MAX_QUEUE_REQUESTS": "7", "ACCESS_LOG": "false",
           "HEADER_TIMEOUT_S": "2.5", "CUDA_GRAPH_BUCKETS": "64,16", "CPU_THREADS": "3",
           "SERVED_MODEL_NAME": "m"}
    eng, srv = resolve(load_settings(env), cuda_available=False)
    assert (eng.page_size, eng.max_queue_requests, eng.cpu_threads) == (32, 7, 3)
    assert eng.cuda_graph_buckets == (16, 64) and eng.cuda_graph_max_tokens == 0  # no CUDA
    assert (eng.device, eng.dtype) == ("cpu", "float32")
    assert (srv.access_log, srv.header_timeout_s, srv.served_model_name) == (False, 2.5, "m")


def test_the_readme_settings_table_is_the_generated_one():
    """`python -m service.settings_table` prints the table; README.md holds it verbatim."""
    text = README.read_text()
    block = re.search(r"\| variable \| default \| meaning \|\n(?:\|.*\|\n)+", text)
    assert block, "README.md has no settings table"
    assert block.group(0).rstrip("\n") == settings_table(), (
        "README.md's settings table differs from the settings: paste "
        "`python -m service.settings_table` over it")


def test_model_help_names_every_family_and_preset():
    """MODEL_PATH's and MODEL_PRESET's help (and so the README's table) follow the registry."""
    path = Settings.model_fields["model_path"].description
    assert all(a in path for f in FAMILIES.values() for a in f.architectures)
    assert all(f"`{f.gguf_arch}`" in path for f in FAMILIES.values() if f.gguf_arch)
    preset = Settings.model_fields["model_preset"].description
    assert all(f"`{p}`" in preset for p in PRESETS)


def test_the_readme_models_table_has_a_row_per_family():
    table = re.search(r"\| family \| checkpoints \| formats \| checked against \|\n\|.*\|\n"
                      r"((?:\|.*\|\n)+)", README.read_text())
    assert table, "README.md has no models table"
    rows = [r.split(" | ") for r in table.group(1).splitlines()]
    assert len(rows) == len(FAMILIES), "README.md's models table: one row per family"
    for f in FAMILIES.values():
        row = next((r for r in rows if f"`{f.architectures[0]}`" in r[1]), None)
        assert row, f"README.md's models table has no row for {f.name}"
        assert all(f"`{a}`" in row[1] for a in f.architectures), f.name
        assert (f"GGUF `{f.gguf_arch}`" in row[2]) == bool(f.gguf_arch), f.name
