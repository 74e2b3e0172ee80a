"""A recommendation's config patch as the TOML a user pastes into `--config FILE`."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["patch_to_dotted", "patch_to_toml"]


def patch_to_toml(patch: dict[str, Any]) -> str:
    """Render a nested config patch as TOML tables.

    `None` values mean "back to the default" and have no TOML spelling, so they are
    written as comments.

    Example:
        >>> print(patch_to_toml({"ddp": {"bucket_cap_mb": 100}}), end="")
        [ddp]
        bucket_cap_mb = 100
    """
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if scalars:
            if prefix:
                lines.append(f"[{prefix}]")
            for key, value in scalars.items():
                if value is None:
                    lines.append(f"# {_key(key)} = (default)")
                else:
                    lines.append(f"{_key(key)} = {_value(value)}")
            lines.append("")
        for key, sub in tables.items():
            emit(sub, f"{prefix}.{_key(key)}" if prefix else _key(key))

    emit(patch, "")
    return "\n".join(lines).rstrip() + "\n" if lines else ""


def _key(key: Any) -> str:
    k = str(key)
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    return json.dumps(str(value))


def patch_to_dotted(patch: dict[str, Any]) -> list[str]:
    """One TOML dotted-key line per patched option, for compact display.

    Example:
        >>> patch_to_dotted({"dataloader": {"num_workers": 3}})
        ['dataloader.num_workers = 3']
    """
    lines: list[str] = []

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            name = f"{prefix}.{_key(key)}" if prefix else _key(key)
            if isinstance(value, dict):
                walk(value, name)
            elif value is None:
                lines.append(f"{name} = (default)")
            else:
                lines.append(f"{name} = {_value(value)}")

    walk(patch, "")
    return lines
