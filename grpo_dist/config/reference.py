"""The configuration's reference, read from its definitions: every key with its default and its description, for
`grpo-dist reference` and the site's configuration page."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from grpo_dist.config import Config, _section_type


def field_docs(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field: the site's configuration page and `grpo-dist reference`."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_type(field.annotation)
        if section is not None and typing.get_origin(field.annotation) is not list:
            rows.append((key, "", field.description or ""))
            rows.extend(field_docs(section, prefix=f"{key}."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((key, default, field.description or ""))
        if section is not None:  # a list of sections: document the fields of one item
            rows.extend(field_docs(section, prefix=f"{key}[]."))
    return rows
