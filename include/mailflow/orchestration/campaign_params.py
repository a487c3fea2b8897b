"""The ``campaign_create`` trigger form, generated from the one model of a scheduled campaign:
one Airflow Param per :class:`~mailflow.sources.scheduled.definition.CampaignDefinition` field,
from its JSON schema (``by_alias``: the ``from`` key), with the field's type, enum, bounds,
pattern, description and default. A field added to the model appears in the form by itself;
the task still validates everything again with :func:`parse_definition` (the form is a help, the
model is the rule)."""

from __future__ import annotations

from typing import Any

from mailflow.sources.scheduled.definition import CampaignDefinition

#: JSON-schema keywords carried into a Param's schema (the rest, e.g. ``title``, is set apart)
_KEYWORDS = ("type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
             "maxLength", "pattern", "format", "items", "minItems", "maxItems", "uniqueItems")


def _field_defaults() -> dict[str, tuple[bool, Any]]:
    """alias -> (required, default) from the model's fields (``default_factory`` called)."""
    out = {}
    for name, f in CampaignDefinition.model_fields.items():
        key = f.alias or name
        out[key] = (f.is_required(), None if f.is_required() else f.get_default(call_default_factory=True))
    return out


def _flatten(prop: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` (an optional field) -> X with ``type: [X.type, "null"]``."""
    any_of = prop.get("anyOf")
    if not any_of:
        return dict(prop)
    kinds = [p for p in any_of if p.get("type") != "null"]
    nullable = len(kinds) < len(any_of)
    if len(kinds) != 1:
        raise ValueError(f"cannot express {prop} as one Param")
    out = {**{k: v for k, v in prop.items() if k != "anyOf"}, **kinds[0]}
    if nullable:
        out["type"] = [out["type"], "null"]
    return out


def definition_param_schemas() -> dict[str, dict[str, Any]]:
    """The Param arguments of every definition field, in the model's field order: ``{key:
    {"default"?: value, "description": text, "title": text, **json-schema keywords}}``; a required
    field has no ``default`` (the form requires it)."""
    schema = CampaignDefinition.model_json_schema(by_alias=True)
    defaults = _field_defaults()
    out: dict[str, dict[str, Any]] = {}
    for key, raw in schema["properties"].items():
        prop = _flatten(raw)
        spec: dict[str, Any] = {k: prop[k] for k in _KEYWORDS if k in prop}
        spec["title"] = str(prop.get("title") or key)
        spec["description"] = str(prop.get("description") or prop.get("title") or key)
        required, default = defaults[key]
        if not required:
            spec["default"] = default
        out[key] = spec
    return out


def definition_params() -> dict[str, Any]:
    """``{key: airflow.sdk.Param}`` for the DAG's ``params`` (see :func:`definition_param_schemas`)."""
    from airflow.sdk import Param

    params = {}
    for key, spec in definition_param_schemas().items():
        spec = dict(spec)
        if "default" in spec:
            default = spec.pop("default")
            params[key] = Param(default, **spec)
        else:
            params[key] = Param(**spec)
    return params


def definition_from_params(params: Any) -> dict[str, Any]:
    """The definition mapping of a run's Params: the definition keys only, and a blank optional
    field (None, or an empty text the form sends for a cleared box) left out, so the model's
    default applies."""
    keys = definition_param_schemas()
    out = {}
    for key in keys:
        value = params.get(key) if params is not None else None
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        out[key] = value
    return out
