"""Validation against the released CRDs vendored under crds/ (crds/README.md names their sources).

The openAPIV3Schema of a CRD version is checked with jsonschema, as strictly as the API server's
field validation: a field the schema does not declare is an error (a misspelt key would otherwise
be pruned without a word). The API server also evaluates the schema's CEL rules
(x-kubernetes-validations); jsonschema cannot, so each rule the vendored CRDs carry has its Python
twin in CEL_RULES, and a rule without one fails the check until it gets one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"
INFERENCE_EXTENSION = CRDS / "inference-extension-v1.6.0"

# CEL rule text (as in the CRD) -> the same predicate over the object it is attached to.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    # InferencePool spec.endpointPickerRef; `kind` defaults to Service
    "self.kind != 'Service' || has(self.port)": lambda ref: (
        ref.get("kind", "Service") != "Service" or "port" in ref
    ),
    # InferencePool spec.targetPorts
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda ports: all(
        sum(p2.get("number") == p1.get("number") for p2 in ports) == 1 for p1 in ports
    ),
}


def _strict(schema: dict) -> dict:
    """The schema with undeclared fields forbidden wherever it declares properties."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def crd_schemas(directory: Path = INFERENCE_EXTENSION) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, for every served version of the CRDs in directory."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


def _cel_problems(schema: dict, obj: Any, where: str) -> list[str]:
    """Evaluate the schema's x-kubernetes-validations on obj and everything below it."""
    problems = []
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            problems.append(f"{where}: CEL rule {rule['rule']!r} has no twin in CEL_RULES")
        elif not check(obj):
            problems.append(f"{where}: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in obj:
                problems += _cel_problems(sub, obj[key], f"{where}.{key}".lstrip("."))
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            problems += _cel_problems(schema["items"], item, f"{where}[{i}]")
    return problems


def check_against_crd(doc: dict) -> list[str]:
    """Problems with doc under its vendored CRD's schema (strict fields, CEL rules included)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    schema = crd_schemas()[key]
    validator = jsonschema.Draft7Validator(_strict(schema))
    problems = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]
    meta = doc.get("metadata", {})
    if not meta.get("name"):
        problems.append("metadata.name is required")
    return problems + _cel_problems(schema, doc, "")
