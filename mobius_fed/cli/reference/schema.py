"""The coordinator's REST API as a page: its routes, then every model they return as a
field table, read from the OpenAPI schema the coordinator serves (``/openapi.json``)."""

from __future__ import annotations

import json
from typing import Any

from mobius_fed.cli.reference.markdown import NOTE, cell

PAGE = "reference/status.md"
REF = "#/components/schemas/"


def openapi() -> dict[str, Any]:
    """The schema a coordinator serves, from an app over an empty run."""
    from mobius_fed.coordinator.rest import make_app
    from mobius_fed.coordinator.state import RunState

    state = RunState(run_id="reference", P=1, steps=1, strategy="fedavg")
    schema: dict[str, Any] = make_app(state).openapi()
    return schema


def _name(ref: str) -> str:
    return ref.removeprefix(REF)


def type_of(prop: dict[str, Any]) -> str:
    """A property's JSON type in words, models linked to their table."""
    if "$ref" in prop:
        name = _name(prop["$ref"])
        return f"[{name}](#{name.lower()})"
    if "anyOf" in prop:
        return " or ".join(type_of(p) for p in prop["anyOf"])
    kind = prop.get("type", "any")
    if kind == "array":
        items = prop.get("items", {})
        return f"array of {'({})' if 'anyOf' in items else '{}'}".format(type_of(items))
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"object of {type_of(values)}" if isinstance(values, dict) else "object"
    return str(kind)


def refs(schema: Any) -> list[str]:
    """Names of the models ``schema`` refers to, in the order they appear."""
    if isinstance(schema, dict):
        own = [_name(schema["$ref"])] if "$ref" in schema else []
        return own + [r for v in schema.values() for r in refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in refs(v)]
    return []


def model_order(api: dict[str, Any]) -> list[str]:
    """Every model, breadth first from the routes' responses in route order."""
    components = api["components"]["schemas"]
    order: list[str] = []
    responses = [
        (code.startswith("2"), r)
        for methods in api["paths"].values()
        for op in methods.values()
        for code, r in op["responses"].items()
    ]
    queue = refs([r for ok, r in responses if ok]) + refs([r for ok, r in responses if not ok])
    while queue:
        name = queue.pop(0)
        if name not in order:
            order.append(name)
            queue += refs(components[name])
    return order


def route_rows(api: dict[str, Any]) -> list[str]:
    rows = ["| Route | Returns | What it says |", "|---|---|---|"]
    for path, methods in api["paths"].items():
        for method, op in methods.items():
            returns = []
            for code, response in op["responses"].items():
                content = response.get("content", {})
                kinds = [
                    type_of(c["schema"]) if "schema" in c else f"`{mime}`"
                    for mime, c in content.items()
                ]
                returns.append(f"{code}: {', '.join(kinds) or '—'}")
            what = cell(op.get("description", "")).replace("``", "`")
            rows.append(f"| `{method.upper()} {path}` | {'; '.join(returns)} | {what} |")
    return rows


def model_section(name: str, schema: dict[str, Any]) -> list[str]:
    """A model's field table, or an enumeration's values."""
    lines = [f"## {name}", ""]
    if schema.get("description"):
        lines += [cell(schema["description"]).replace("``", "`"), ""]
    if "enum" in schema:
        values = ", ".join(f"`{v}`" for v in schema["enum"])
        return [*lines, f"A {schema.get('type', 'value')}, one of {values}.", ""]
    lines += ["| Field | Type | Default | Meaning |", "|---|---|---|---|"]
    for field, prop in schema.get("properties", {}).items():
        default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
        meaning = cell(prop.get("description", ""))
        lines.append(f"| `{field}` | {type_of(prop)} | {default} | {meaning} |")
    return [*lines, ""]


INTRO = """\
The coordinator's REST API ([Status, dashboard, metrics](../operations.md) says how to
reach it): the routes, then every document they return, field by field; each field is
always present, `null` where it has no value. The same schema is served live
at `/openapi.json`, with Swagger UI at `/docs` and ReDoc at `/redoc`; gRPC `GetStatus`
returns the same status document. The Prometheus metrics at `/metrics` are listed in
[Metrics](metrics.md)."""


def status_page() -> str:
    """``reference/status.md``: routes, then the models breadth first."""
    api = openapi()
    lines = ["# Status and REST schema", "", NOTE, "", INTRO, "", "## Routes", ""]
    lines += [*route_rows(api), ""]
    components = api["components"]["schemas"]
    for name in model_order(api):
        lines += model_section(name, components[name])
    return "\n".join(lines)
