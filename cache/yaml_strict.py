"""A YAML loader for the files people write by hand: a key written twice is caught, not dropped.

The topology, the schedule and a node's ``--config`` file are all read with
it. PyYAML keeps the last value of a repeated key without a word (a second
``jobs:`` dropped the first block's jobs; a second ``capacity:`` in a node's
file overrode the first), and its resolver turns ``2026-12-02T25:00:00Z`` into a
timestamp whose constructor raises a bare ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKey", "StrictLoader", "yaml_problem"]

# libyaml's parser where PyYAML has it (its wheels do): faster (1.5-4x), and it refuses
# nesting deeper than 1,000 at once, where the pure-Python scanner is quadratic in the
# depth (a line of 9,000 "[" took 9 s).
_BASE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class DuplicateKey(yaml.YAMLError):
    """A key written twice in one mapping: YAML would keep only the last silently."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"key {key!r} appears twice (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


class StrictLoader(_BASE_LOADER):  # type: ignore[valid-type, misc]
    """The safe loader, refusing a key repeated in one mapping.

    PyYAML keeps the last value of a repeated key without a word, so a second
    ``jobs:`` would drop the first block's jobs. A merge (``<<``) may still
    override keys it brings in: that is what it is for. The repeats are kept in
    :attr:`duplicates`, to be reported with the file's other problems.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[DuplicateKey] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping, as the safe loader builds it; its repeated keys noted first."""
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        # Collected, not raised: the file's other problems are said with it.
                        self.duplicates.append(DuplicateKey(key, seen[key], line))
                    seen[key] = line
                except TypeError:
                    continue  # an unhashable key: the base constructor says so
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]

    def construct_yaml_timestamp(self, node: yaml.ScalarNode) -> Any:
        """A timestamp, or its text when it is not a real time (hour 25, February 30).

        PyYAML's resolver takes any ``2026-12-02T25:00:00Z`` for a timestamp and its
        constructor raises (ValueError: hour must be in 0..23), which only said "not
        valid YAML" with no line or field. As text, the field's check reports it as
        for a quoted value: file, line, field, and how to write a time.
        """
        try:
            return super().construct_yaml_timestamp(node)
        except (ValueError, OverflowError):
            return self.construct_scalar(node)


StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", StrictLoader.construct_yaml_timestamp)


def yaml_problem(path: object, exc: yaml.YAMLError) -> str:
    """One line for a YAML mistake: file, line and column, what is wrong, what to check.

    PyYAML's own text runs over several lines and names "<unicode string>"
    rather than the file; most mistakes in hand-written files are tabs and
    indentation, so the advice is about those. Every file read with
    :class:`StrictLoader` says its mistakes this way (a node's ``--config`` gave
    PyYAML's raw text where the topology gave this line).
    """
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"{path}: not valid YAML ({' '.join(str(exc).split())})"
    problem = getattr(exc, "problem", None) or "cannot be read"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        problem += f" ({context} at line {context_mark.line + 1})"
    if "tab" in problem or "'\\t'" in problem:  # libyaml: "found character '\t' that …"
        advice = "indent with spaces, not tabs"
    else:
        advice = "check the indentation (spaces; keys of one item line up) and quoting here"
    where = f"{path}:{mark.line + 1}: not valid YAML at column {mark.column + 1}"
    return f"{where}: {problem}; {advice}"
