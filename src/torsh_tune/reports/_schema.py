"""Validate report.json documents against `report.schema.json` (shipped beside this module).

A small validator for the JSON-Schema subset the schema uses (type, const, enum, minimum,
properties, required, additionalProperties, items), so checking a report needs no extra
dependency; any JSON-Schema 2020-12 validator (e.g. `jsonschema`) accepts the same file.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import invalid

__all__ = ["REPORT_SCHEMA_PATH", "report_schema", "report_schema_errors", "validate_report"]

#: The JSON Schema of report.json (schema_version 1).
REPORT_SCHEMA_PATH = Path(__file__).with_name("report.schema.json")

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_KNOWN = {"$schema", "$id", "title", "description", "type", "const", "enum", "minimum", "properties", "required",
          "additionalProperties", "items"}


@functools.cache
def report_schema() -> dict[str, Any]:
    """The parsed report.schema.json."""
    return json.loads(REPORT_SCHEMA_PATH.read_text(encoding="utf-8"))


def report_schema_errors(doc: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every place where `doc` breaks the schema, as "path: problem" lines (empty: valid).

    Example:
        >>> report_schema_errors({"schema_version": 1})[:1]
        ['$: missing required key generated_at']
    """
    errors: list[str] = []
    _check(doc, schema if schema is not None else report_schema(), "$", errors)
    return errors


def validate_report(doc_or_path: Any) -> dict[str, Any]:
    """Check a report.json document (or the path of one) against the schema.

    Returns:
        The document.

    Raises:
        ConfigError: naming the first problem and how many there are.
    """
    doc = doc_or_path
    if isinstance(doc_or_path, (str, os.PathLike)):
        doc = json.loads(Path(doc_or_path).read_text(encoding="utf-8"))
    errors = report_schema_errors(doc)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise invalid("report.json", "valid against report.schema.json", f"{errors[0]}{more}")
    return doc


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    unknown = set(schema) - _KNOWN
    assert not unknown, f"schema keyword(s) {sorted(unknown)} at {path} are not supported by this validator"
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: must be {schema['const']!r}, got {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {schema['enum']}, got {value!r}")
        return
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            errors.append(f"{path}: must be of type {' or '.join(types)}, got {type(value).__name__} {value!r:.60}")
            return
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        errors.append(f"{path}: must be >= {schema['minimum']}, got {value!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing required key {key}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unknown key {key}")
            elif isinstance(extra, dict):
                _check(item, extra, f"{path}.{key}", errors)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", errors)
