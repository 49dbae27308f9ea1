"""The memory-optimizer configuration grammar.

ONNX Runtime Training names a recompute plan as ``SubgraphStr:OptimizationType:RequestApplyCount``:

* ``SubgraphStr`` is the cluster id of a subgraph, a sequence of ``OpName+`` parts (``BiasGelu+``,
  ``Reshape+Where+BiasSoftmax+``);
* ``OptimizationType`` is 0 (none), 1 (recompute) or 2 (recompute with compromise);
* ``RequestApplyCount`` is -1 (every occurrence) or how many occurrences to apply it to.

ORT 1.19 reads the plans from a JSON file holding a list of those strings (the inline string of
older releases fails there with a C++ parse error at the first training step). This module parses
and validates what the user wrote, before training starts, and writes and reads that file.
"""

import json
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

FLAG = "--memory_opt_config"
EXAMPLE = "BiasGelu+:1:-1"
OPTIMIZATION_TYPES = {0: "none", 1: "recompute", 2: "recompute with compromise"}
# Reserved word: let the advisor choose plans from measurements (optimum_memopt.advisor).
AUTO = "auto"

_SUBGRAPH_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*\+)+$")
_PART_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+")


@dataclass(frozen=True)
class MemoryOptEntry:
    """One recompute plan: ``subgraph:optimization_type:apply_count``."""

    subgraph: str
    optimization_type: int = 1
    apply_count: int = -1

    def __str__(self) -> str:
        return f"{self.subgraph}:{self.optimization_type}:{self.apply_count}"

    @property
    def enabled(self) -> bool:
        return self.optimization_type != 0


def _types_text() -> str:
    return "0 (none), 1 (recompute) or 2 (recompute with compromise)"


def _parse_int(text: str, what: str, expected: str) -> int:
    """An integer written as one ('1', '-1'); '1.0', 'x' or '' are refused with ``what`` and ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or str(value) != text.lstrip("+"):
        raise ValueError(f"{what} {text!r}, not an integer; {expected}")
    return value


def parse_entry(text: str, source: str = "") -> MemoryOptEntry:
    """Parse and validate one ``Subgraph+:type:count`` string.

    ``source`` names where the entry came from (a JSON file), for the error message.
    """
    where = f" in {source}" if source else ""
    prefix = f"`{FLAG}` entry {text!r}{where}"
    fields = text.split(":")
    if len(fields) != 3:
        raise ValueError(
            f"{prefix} has {len(fields)} ':'-separated field(s); expected 3, "
            f"SubgraphStr:OptimizationType:RequestApplyCount, as in {EXAMPLE!r}"
        )
    subgraph, type_text, count_text = (f.strip() for f in fields)
    if not subgraph:
        raise ValueError(f"{prefix} has an empty subgraph; expected a sequence of 'OpName+' parts, as in {EXAMPLE!r}")
    if not _SUBGRAPH_RE.match(subgraph):
        if not subgraph.endswith("+"):
            detail = "does not end with '+'"
        else:
            bad = _PART_RE.sub("", subgraph) or subgraph
            detail = f"has an invalid part {bad!r}"
        raise ValueError(
            f"{prefix} has subgraph {subgraph!r} that {detail}; expected a sequence of 'OpName+' parts "
            f"such as 'BiasGelu+' or 'Reshape+Where+BiasSoftmax+', as in {EXAMPLE!r}"
        )
    types_expected = f"expected {_types_text()}, as in {EXAMPLE!r}"
    counts_expected = f"expected -1 (all occurrences) or a positive integer, as in {EXAMPLE!r} or 'BiasGelu+:1:2'"
    opt_type = _parse_int(type_text, f"{prefix} has optimization type", types_expected)
    if opt_type not in OPTIMIZATION_TYPES:
        raise ValueError(f"{prefix} has optimization type {opt_type}; {types_expected}")
    count = _parse_int(count_text, f"{prefix} has apply count", counts_expected)
    if count == 0 or count < -1:
        raise ValueError(f"{prefix} has apply count {count}; {counts_expected}")
    return MemoryOptEntry(subgraph, opt_type, count)


def _check_duplicates(entries: Sequence[MemoryOptEntry], source: str = "") -> None:
    seen = {}
    where = f" in {source}" if source else ""
    for entry in entries:
        if entry.subgraph in seen:
            raise ValueError(
                f"`{FLAG}` names subgraph {entry.subgraph!r} twice{where} ({str(seen[entry.subgraph])!r} and "
                f"{str(entry)!r}); give each subgraph once, as in 'BiasGelu+:1:-1,Cast+:2:-1'"
            )
        seen[entry.subgraph] = entry


def parse_entries(text: str) -> List[MemoryOptEntry]:
    """Parse the inline form: comma-separated entries."""
    parts = text.split(",")
    entries = []
    for i, part in enumerate(parts):
        part = part.strip()
        if not part:
            raise ValueError(
                f"`{FLAG}` value {text!r} has an empty entry at position {i + 1}; separate plans with "
                f"single commas, as in 'BiasGelu+:1:-1,Cast+:2:-1'"
            )
        entries.append(parse_entry(part))
    _check_duplicates(entries)
    return entries


def looks_like_path(value: str) -> bool:
    return value.lower().endswith(".json") or os.sep in value or os.path.exists(value)


def read_json_file(path: str) -> List[MemoryOptEntry]:
    """Read a JSON file holding a list of plan strings, as ORT 1.19 expects it."""
    if not os.path.exists(path):
        raise ValueError(
            f"`{FLAG}` file {path!r} does not exist; give an existing JSON file holding a list of plans, "
            f'such as ["BiasGelu+:1:-1"], or the plans inline, as in {EXAMPLE!r}'
        )
    if os.path.isdir(path):
        raise ValueError(f"`{FLAG}` path {path!r} is a directory; expected a JSON file holding a list of plans, "
                         f'such as ["BiasGelu+:1:-1"]')
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"`{FLAG}` file {path!r} cannot be read ({e}); expected a readable JSON file "
                         f'holding a list of plans, such as ["BiasGelu+:1:-1"]') from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"`{FLAG}` file {path!r} is not valid JSON ({e}); expected a list of plans, "
                         f'such as ["BiasGelu+:1:-1", "Cast+:2:-1"]') from None
    if not isinstance(data, list):
        raise ValueError(
            f"`{FLAG}` file {path!r} holds a JSON {type(data).__name__}, not a list; expected a list of plans, "
            f'such as ["BiasGelu+:1:-1", "Cast+:2:-1"]'
        )
    if not data:
        raise ValueError(f"`{FLAG}` file {path!r} holds an empty list; list at least one plan, such as "
                         f'["BiasGelu+:1:-1"], or leave the flag out to turn the memory optimizer off')
    entries = []
    for i, item in enumerate(data):
        if not isinstance(item, str):
            raise ValueError(
                f"`{FLAG}` file {path!r} item {i} is {item!r} ({type(item).__name__}), not a string; expected "
                f'plan strings, such as ["BiasGelu+:1:-1"]'
            )
        if not item.strip():
            raise ValueError(f"`{FLAG}` file {path!r} item {i} is an empty string; expected a plan such as "
                             f"{EXAMPLE!r}")
        entries.append(parse_entry(item.strip(), source=f"file {path!r}"))
    _check_duplicates(entries, source=f"file {path!r}")
    return entries


def parse_memory_opt_config(value: Optional[Union[str, Sequence[str]]]) -> List[MemoryOptEntry]:
    """Turn the flag's value into validated entries.

    Accepts ``None``/``""`` (off), the inline comma-separated form, a path to a JSON file
    holding a list of plan strings, or an already split list of plan strings.
    """
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        entries = [parse_entry(str(v).strip()) for v in value]
        _check_duplicates(entries)
        return entries
    value = value.strip()
    if not value:
        return []
    if looks_like_path(value):
        return read_json_file(value)
    return parse_entries(value)


def to_json_list(entries: Sequence[MemoryOptEntry]) -> List[str]:
    return [str(e) for e in entries]


def write_json_file(entries: Sequence[MemoryOptEntry], path: str) -> str:
    """Write the entries as ORT 1.19 reads them: a JSON list of strings."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_json_list(entries), f)
    os.replace(tmp, path)
    return path


def to_inline(entries: Sequence[MemoryOptEntry]) -> str:
    return ",".join(str(e) for e in entries)
