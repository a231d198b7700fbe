"""Reading a YAML config file strictly: UTF-8 only, and no key given twice in one mapping.

PyYAML keeps the last of two equal keys without a word, so a file with ``optimizer:`` twice
silently loses the first section; and a file with a non-UTF-8 byte (saved as cp1252) is a
``UnicodeDecodeError`` traceback. Both become one ``ConfigError`` line naming the file, and the
line or byte offset.
"""

from __future__ import annotations

from typing import Any

import yaml

from megatron_stare.config.fields import ConfigError

__all__ = ["read_yaml"]


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key given twice in one mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)  # merge keys (<<) may repeat what they merge: that is allowed
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first on line {seen[key] + 1}); YAML would keep "
                            f"only the last: merge the two into one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path: str) -> Any:
    """The YAML document of ``path``; one ``ConfigError`` line for undecodable or invalid text."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: byte 0x{raw[e.start]:02x} at offset {e.start} is not UTF-8; "
                          f"save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{at} is not valid YAML ({getattr(e, 'problem', e)})") from None
