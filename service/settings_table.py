"""The README's settings table, generated from Settings: `python -m service.settings_table`."""

from __future__ import annotations

from service.config import Settings


def settings_table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra or {}
        default = extra.get("shown_default")
        if default is None:
            value = field.default
            text = str(value).lower() if isinstance(value, bool) else str(value)
            default = "unset" if value is None else f"`{text}`"
        rows.append(f"| `{name.upper()}` | {default} | {field.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
