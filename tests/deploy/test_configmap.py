"""The base ConfigMap says the settings' defaults, each a Settings variable, but its overrides."""

from __future__ import annotations

from deploy_testlib import DEPLOY, load_yaml_docs

from service.config import Settings, load_settings

# What production sets on purpose, and why
OVERRIDES = {"DEVICE": "cuda"}  # a pod without its GPU fails at start-up instead of serving on CPU


def test_every_key_is_a_setting_at_its_default_but_the_overrides() -> None:
    data = load_yaml_docs((DEPLOY / "base" / "configmap.yaml").read_text())[0]["data"]
    unknown = sorted(k for k in data if k.lower() not in Settings.model_fields)
    assert not unknown, f"ConfigMap keys that are no setting: {unknown}"
    assert {k: data[k] for k in OVERRIDES} == OVERRIDES
    defaults, parsed = Settings(), load_settings(data)
    differ = {k: v for k, v in data.items() if k not in OVERRIDES
              and getattr(parsed, k.lower()) != getattr(defaults, k.lower())}
    assert not differ, f"ConfigMap values other than the settings' defaults: {differ}"
