"""Reading a workload or hardware YAML file strictly, with one-line errors that name the file and key.

OmegaConf would read a duplicate key's last value or turn a bare scalar into a mapping; both hide a
typo, so the document's shape is checked on its node tree before any value is built.
"""

from __future__ import annotations

import io
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"
_KINDS = {yaml.ScalarNode: "a scalar", yaml.SequenceNode: "a list"}


def _where(mark: yaml.Mark | None) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: what went wrong and where."""
    if isinstance(err, yaml.MarkedYAMLError):
        return f"{err.problem or err.context or 'invalid YAML'}{_where(err.problem_mark or err.context_mark)}"
    return str(err).splitlines()[0]


def _refuse_duplicates(node: yaml.Node, name: str, prefix: str = "") -> None:
    """Every mapping in the tree names each key once (``<<`` merges are YAML's way of repeating)."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(item, name, f"{prefix}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
        line = key_node.start_mark.line + 1
        if key in lines:
            raise ConfigError(f"{name}: {key}", f"appears twice (lines {lines[key]} and {line})",
                              "keep one of them")
        lines[key] = line
        _refuse_duplicates(value_node, name, key)


def read_mapping(path: Path) -> DictConfig:
    """The YAML file at ``path`` as a DictConfig; unreadable, malformed or non-mapping files are errors."""
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(name, "is not a UTF-8 text file", "pass a YAML file") from None
    except OSError as err:
        raise ConfigError(name, f"cannot be read: {err.strerror or err}", "check the path and its permissions") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(name, f"is not valid YAML: {_yaml_problem(err)}", "fix the YAML syntax") from None
    if root is None:
        raise ConfigError(name, "is empty", "write the settings as a mapping of keys to values")
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(name, f"holds {_KINDS.get(type(root), 'a value')} at the top level, not a mapping",
                          "write the settings as 'key: value' lines")
    _refuse_duplicates(root, name)
    try:
        data = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as err:  # what the node tree does not show: anchors expanded past OmegaConf's limits
        raise ConfigError(name, f"is not valid YAML: {_yaml_problem(err)}", "fix the YAML") from None
    except OmegaConfBaseException as err:
        raise ConfigError(name, str(err).splitlines()[0], "fix the YAML") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(name, "is not a mapping at the top level", "write the settings as 'key: value' lines")
    return data
