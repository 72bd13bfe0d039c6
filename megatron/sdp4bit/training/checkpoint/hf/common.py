"""What every architecture's adapter shares: the error, the model-settings arithmetic and the
config checks."""

from __future__ import annotations


class MappingError(ValueError):
    """What stops an import or an export; one line with the reason."""


ExportError = MappingError


def head_dim(model: dict) -> int:
    """The attention head size of the settings (``--kv-channels``, default hidden / heads)."""
    return model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]


def kv_heads(model: dict) -> int:
    """The key/value heads of the settings (the query groups with grouped-query attention)."""
    if model.get("group_query_attention"):
        return model["num_query_groups"]
    return model["num_attention_heads"]


def differences(model: dict, needs: dict) -> list[str]:
    """``"key is X (needs Y)"`` for each setting of ``needs`` the model lacks."""
    return [f"{k} is {model.get(k)!r} (needs {v!r})" for k, v in needs.items()
            if model.get(k) != v]


def need(wrong: list[str], config, field: str, accepted, why: str = "") -> None:
    """Append to ``wrong`` when the transformers config's ``field`` is not in ``accepted``
    (a config without the field has ``accepted[0]``)."""
    value = getattr(config, field, accepted[0])
    if value not in accepted:
        wrong.append(f"{field} {value!r} (needs {' or '.join(map(repr, accepted))}{why})")


def as_flags(*values: object) -> list[str]:
    return [str(x) for x in values]
