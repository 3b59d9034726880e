#!/usr/bin/env python3
"""Writes the JSON Schema of one version of a CustomResourceDefinition, made strict for offline
validation as helm/schemas/README.md describes: the version's openAPIV3Schema with
`additionalProperties: false` on every object schema that lists properties (unless it keeps
unknown fields), Go-style `(?i)` patterns and descriptions dropped, apiVersion and kind pinned.

Usage: scripts/crd-schema.py CRD.yaml VERSION OUT.json"""

import json
import sys

import yaml


def strict(node):
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "pattern" and isinstance(value, str) and value.startswith("(?i)"):
            continue
        # A property may itself be named "description" or "pattern": keep those.
        out[key] = strict(value) if key != "properties" else {k: strict(v) for k, v in value.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def main():
    crd_path, version, out_path = sys.argv[1:]
    crd = next(d for d in yaml.safe_load_all(open(crd_path)) if d and d.get("kind") == "CustomResourceDefinition")
    spec = crd["spec"]
    found = next(v for v in spec["versions"] if v["name"] == version)
    schema = strict(found["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{spec['group']}/{version}"}
    schema["properties"]["kind"] = {"const": spec["names"]["kind"]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    with open(out_path, "w") as f:
        json.dump(schema, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")


main()
