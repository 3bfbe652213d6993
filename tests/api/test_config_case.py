"""Settings accept the casing operators write (INFO, CUDA, BFloat16) and still refuse nonsense."""

from __future__ import annotations

import pytest

from service.config import ConfigError, load_settings


def test_case_insensitive_choices():
    s = load_settings({"LOG_LEVEL": "INFO", "DEVICE": "CPU", "DTYPE": "BFloat16"})
    assert (s.log_level, s.device, s.dtype) == ("info", "cpu", "bfloat16")


@pytest.mark.parametrize("var,value", [("LOG_LEVEL", "LOUD"), ("MEM_FRACTION_STATIC", "1.0"),
                                       ("MEM_FRACTION_STATIC", "0"), ("PAGE_SIZE", "zero")])
def test_bad_values_name_the_variable(var, value):
    with pytest.raises(ConfigError) as e:
        load_settings({var: value})
    assert var in str(e.value) and value.lower() in str(e.value).lower()


def test_dp_size_above_one_is_refused_at_start_up():
    from service.config import resolve

    with pytest.raises(ConfigError, match="DP_SIZE=2: the HTTP service runs one rank"):
        resolve(load_settings({"DP_SIZE": "2"}), cuda_available=False)


def test_access_log_switch_reaches_the_server_config():
    from service.config import resolve

    assert resolve(load_settings({}), cuda_available=False)[1].access_log is True
    assert resolve(load_settings({"ACCESS_LOG": "false"}), cuda_available=False)[1].access_log \
        is False
