"""Generate the ShardedModel CustomResourceDefinition from the Pydantic models.

Pydantic writes JSON Schema (draft 2020-12); the API server wants a structural OpenAPI v3
schema. The conversion inlines `$ref`s, turns `X | None` into an optional X, drops what a
structural schema forbids (titles, `propertyNames`), and keeps descriptions, defaults,
patterns, bounds, enums and the CEL rules (`x-kubernetes-validations`).

`python -m preshard.api.crd` prints the CRD; `make crds` writes it to `crds/` and to the chart.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from preshard.api import models
from preshard.api.status import ShardedModelStatus

Schema = dict[str, Any]

# Keys of JSON Schema that a structural schema does not accept or that carry no meaning here.
# Map keys are checked by the Pydantic model (and, where it matters, by a CEL rule).
_DROPPED_KEYS = frozenset(
    {"title", "propertyNames", "patternProperties", "$defs", "additionalProperties"}
)

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether every shard set is verified and every target rolled out to it.",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Why the ShardedModel is (not) ready.",
    },
    {
        "name": "TP",
        "type": "string",
        "jsonPath": ".spec.tensorParallelSizes",
        "description": "Tensor-parallel sizes with a shard set.",
    },
    {
        "name": "Progress",
        "type": "string",
        "jsonPath": ".status.shardSets[*].progress",
        "description": "How far the running serialize or reshard Jobs are.",
    },
    {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    },
    {
        "name": "Storage",
        "type": "string",
        "priority": 1,
        "jsonPath": ".spec.storage.uri",
        "description": "Where the shard sets live.",
    },
    {
        "name": "Shard sets",
        "type": "string",
        "priority": 1,
        "jsonPath": ".status.shardSets[*].uri",
        "description": "URI of each shard set.",
    },
]


def _resolve(schema: Schema, definitions: dict[str, Schema]) -> Schema:
    """Inline references and turn a JSON Schema node into a structural one."""
    if "$ref" in schema:
        target = definitions[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _resolve(merged, definitions)
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {len(options)} types structurally")
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
        if schema.get("default") is not None:
            rest["default"] = schema["default"]
        return _resolve({**options[0], **rest}, definitions)

    result: Schema = {}
    for key, value in schema.items():
        if key not in _DROPPED_KEYS:
            result.update(_convert(key, value, definitions))
    values = _map_values(schema)
    if values is not None:
        result["additionalProperties"] = _resolve(values, definitions)
    if "enum" in result and "type" not in result:
        result["type"] = _enum_type(result["enum"])
    return result


def _convert(key: str, value: Any, definitions: dict[str, Schema]) -> Schema:
    """One keyword of a schema node, converted."""
    if key == "properties":
        return {key: {name: _resolve(sub, definitions) for name, sub in value.items()}}
    if key == "items":
        return {key: _resolve(value, definitions)}
    if key == "const":
        return {"enum": [value]}
    if key == "description":
        # Docstrings wrap at the source's line length; `kubectl explain` wraps for the reader.
        return {key: " ".join(value.split())}
    return {key: value}


def _map_values(schema: Schema) -> Schema | None:
    """The schema of a map's values, whether Pydantic wrote it per key pattern or not."""
    if isinstance(schema.get("additionalProperties"), dict):
        values: Schema = schema["additionalProperties"]
        return values
    patterns = schema.get("patternProperties")
    if patterns:
        if len(patterns) != 1:
            raise ValueError("a map may have one key pattern")
        (values,) = patterns.values()
        return values
    return None


def _enum_type(values: list[Any]) -> str:
    if all(isinstance(v, bool) for v in values):
        return "boolean"
    if all(isinstance(v, int) for v in values):
        return "integer"
    return "string"


def structural_schema(model: type[models.ApiModel]) -> Schema:
    """The structural OpenAPI v3 schema of one model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions = raw.get("$defs", {})
    return _resolve(raw, definitions)


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest of ShardedModel."""
    spec_schema = structural_schema(models.ShardedModelSpec)
    status_schema = structural_schema(ShardedModelStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "preshard"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["preshard"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "A model pre-sharded for vLLM: one tensorizer shard set per "
                                "tensor-parallel size, built by a GPU Job, verified, and loaded "
                                "by the target Deployments."
                            ),
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML committed in `crds/`."""
    header = (
        "# Generated from operator/preshard/api/models.py by `make crds`. Do not edit by hand.\n"
    )
    return header + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated values in full: a CRD is read by people, not by a YAML parser only."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


if __name__ == "__main__":
    sys.stdout.write(render_crd())
