"""Recompute plans: the one grammar, and the typed report a backend gives after the first step.

A plan is written ``SubgraphStr:OptimizationType:RequestApplyCount``:

* ``SubgraphStr`` names a subgraph as a sequence of ``OpName+`` parts (``BiasGelu+``,
  ``Reshape+Where+BiasSoftmax+``);
* ``OptimizationType`` is 0 (none), 1 (recompute) or 2 (recompute with compromise);
* ``RequestApplyCount`` is -1 (every occurrence) or how many occurrences to apply it to.

The torch backend also takes (ONNX Runtime's backend refuses them):

* ``Layer+`` as the subgraph: the whole layer recomputed (``Layer+:1:-1`` is level 1, ``Layer+:1:4`` the first 4);
* a layer selector after ``@``, with the count -1: ``Gelu+:1:-1@4-11`` (layers 4 to 11), ``Layer+:1:-1@every2``
  (layers 0, 2, 4... as transformers' ``every_n_layers``), ``Layer+:1:-1@0+5+9`` (items joined by ``+``);
* a lever beyond the layers' op plans, by its plan name (each lever module under ``backends/torch/levers/`` declares
  its `LeverSyntax`): its layers as an op plan's (a count, or an ``@`` selector) where the lever acts in layers, and
  its parameter after them, ``@LAYERS:PARAMETER`` (``MLP+:1:-1@0-7:tiles4``: the MLP of layers 0 to 7 in 4 tiles),
  or alone after ``@`` (``Loss+:1:-1@chunks8``: the head and loss in 8 chunks; ``MLP+:1:4@tiles2``: the first 4
  layers' MLP in 2 tiles). A parameter is a word and a number (``chunks8``, ``tiles4``), the words the lever's syntax
  lists.

A backend describes what it found as *cluster ids*: one or more plans joined by commas
(``Cast+:1:-1,Gelu+:2:-1``), which `parse_cluster_id` reads.

Every plan string the package handles goes through this module. Its errors (`PlanError`) describe
the value only; the caller says where the value came from (a flag, a file, an environment variable).
"""

import difflib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

EXAMPLE = "Gelu+:1:-1"
LAYER = "Layer+"  # the whole layer (torch backend)
_PARAMETER_RE = re.compile(r"^([A-Za-z]+)([0-9]+)$")  # a lever's parameter: a word and a number (`chunks8`)
SELECTOR_EXAMPLE = "'Layer+:1:-1@every2', 'Gelu+:1:-1@4-11' or 'Layer+:1:-1@0+5+9'"
# ASCII digits only (`\d` would take `５` or `٥` as 5); `every` in any case, as op names are
_ITEM_RE = re.compile(r"^(?:([0-9]+)|([0-9]+)-([0-9]+)|every([0-9]+))$", re.IGNORECASE)
MAX_DIGITS = 6  # a layer number or count longer than this names no model's layer (and int() of 4300+ digits raises)
OPTIMIZATION_TYPES = {0: "none", 1: "recompute", 2: "recompute with compromise"}
# Reserved word: let the advisor choose plans from measurements (optimum_memopt.advisor).
AUTO = "auto"

_SUBGRAPH_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*\+)+$")
_PART_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\+")


class PlanError(ValueError):
    """A plan string that does not follow the grammar; the message says why and shows an accepted form."""


@dataclass(frozen=True)
class LeverPart:
    """One part of a lever's option, as one plan entry asks for it: the layers it acts in (None: its whole scope,
    every layer, or the model for a lever acting once a model) and its parameter as data (`word`, `number`: chunks, 8;
    None: the lever's default). `str()`: the entry's text after `@`, for messages ("0-7:tiles4")."""

    layers: Optional[Tuple[int, ...]] = None
    word: Optional[str] = None
    number: Optional[int] = None

    def __str__(self) -> str:
        layers = layer_selector(self.layers) if self.layers else ""
        parameter = f"{self.word}{self.number}" if self.word else ""
        return ":".join(part for part in (layers, parameter) if part)


@dataclass(frozen=True)
class LeverOption:
    """What a policy holds for one lever (`RecomputePolicy.levers`): its parts, one for each plan entry that asked
    for it, in order. `LeverOption()`: the lever at its default on its whole scope (the bare `Loss+:1:-1`). Data, read
    by the lever; its text (`str()`, "0:tiles2;1-3:tiles4") and its plan entries (`LeverSyntax.entries`) are for the
    edges alone: messages, logs, files (tests/test_plans.py round-trips every form)."""

    parts: Tuple[LeverPart, ...] = (LeverPart(),)

    def __str__(self) -> str:
        return ";".join(str(p) for p in self.parts)

    def joined(self, other: "LeverOption") -> "LeverOption":
        """This option and `other`'s parts after it (two entries of one lever)."""
        return LeverOption(self.parts + other.parts)


@dataclass(frozen=True)
class LeverSyntax:
    """How a plan entry names a lever beyond the layers' op plans. Each lever declares its own (the torch backend's
    `levers/`), in a registry registered with this module (`register_levers`); this module reads them by plan name
    (`lever_syntax`) and parses every entry alike."""

    name: str  # the lever's name: its key in the policy's, the engine's and the profile's levers ("loss")
    plan: str  # its subgraph word, as in `Loss+`
    what: str  # what it acts on, a plural noun for messages ("the head and loss")
    layers: bool  # whether it acts in layers (a count or an `@` selector names them), else once a model (count -1)
    parameter: str  # what its parameter is called in messages ("chunking")
    parameters: Tuple[Tuple[str, str], ...]  # its parameter's words and what their number means, in messages
    default: str  # what the entry without a parameter means
    examples: Tuple[str, ...]  # accepted entries, for messages
    once: str = ""  # why a lever acting once a model takes count -1 and one entry ("a model has one head")

    @property
    def example(self) -> str:
        quoted_ = [repr(e) for e in self.examples]
        return ", ".join(quoted_[:-1]) + f" or {quoted_[-1]}" if len(quoted_) > 1 else quoted_[0]

    def option(self, entry: "PlanEntry", n_layers: int) -> LeverOption:
        """What a policy holds for this lever from `entry` (an entry of this lever's, checked by the grammar): its
        parameter as a word and a number (none: its default), and, where it acts in layers, the layers it names in a
        model of `n_layers` (a count or a selector resolved; none named: every layer)."""
        layers = None
        if self.layers and (entry.layers or entry.apply_count != -1):
            layers = tuple(entry.select(n_layers))
        m = _PARAMETER_RE.match(entry.parameter) if entry.parameter else None
        word, number = (m.group(1).lower(), int(m.group(2))) if m is not None else (None, None)
        return LeverOption((LeverPart(layers, word, number),))

    def entries(self, option: LeverOption) -> List["PlanEntry"]:
        """The plan entries that ask for `option` (its inverse: `option(entry)` of each gives its parts back), one a
        part: `Loss+:1:-1@chunks8`, `MLP+:1:-1@0-3:tiles4`."""
        return [
            PlanEntry(
                self.plan,
                1,
                -1,
                layers=layer_selector(p.layers) if p.layers else "",
                parameter=f"{p.word}{p.number}" if p.word else "",
            )
            for p in option.parts
        ]

    def plan_of(self, option: Optional[LeverOption]) -> str:
        """`option` as plans ("Loss+:1:-1@chunks8"; its entries joined by commas), "" for None (the lever off)."""
        return "" if option is None else ",".join(str(e) for e in self.entries(option))

    def parameter_problem(self, parameter: str) -> Optional[str]:
        """What is wrong with `parameter` for this lever, or None."""
        m = _PARAMETER_RE.match(parameter)
        words = {w for w, _ in self.parameters}
        if m is not None and m.group(1).lower() in words and len(m.group(2)) <= MAX_DIGITS and int(m.group(2)) >= 1:
            return None
        ascii_only = (
            ", whose digits are not ASCII (0-9)" if any(c.isdigit() and not c.isascii() for c in parameter) else ""
        )
        accepted = " or ".join(f"'{w}N' ({meaning})" for w, meaning in self.parameters)
        return f"{self.parameter} {quoted(parameter)}{ascii_only}; expected {accepted}, N from 1 to {'9' * MAX_DIGITS}"


def layer_selector(layers: Sequence[int]) -> str:
    """Layer indexes as a selector: [0, 1, 2, 5] -> '0-2+5'."""
    parts, start = [], None
    for k, i in enumerate(layers):
        if start is None:
            start = i
        if k + 1 == len(layers) or layers[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return "+".join(parts)


# The registries the grammar reads the levers' syntax from: dotted module paths, each with `syntax_of(plan_word)` and
# `lever_class(name)`, imported when a lever is first looked up. The grammar imports no backend: the package's face
# registers the torch backend's levers (`optimum_memopt/__init__.py`), a test or another backend may add its own.
LEVER_REGISTRIES: List[str] = []


def register_levers(path: str) -> None:
    """Read the levers' syntax from the module at dotted `path` too (after those registered before)."""
    if path not in LEVER_REGISTRIES:
        LEVER_REGISTRIES.append(path)


def _registries():
    import importlib

    return [importlib.import_module(path) for path in LEVER_REGISTRIES]


def lever_named(name: str) -> LeverSyntax:
    """The syntax of the lever named `name` (`LeverSyntax.name`: "loss"); KeyError for a name no lever has."""
    found = next((c for c in (r.lever_class(name) for r in _registries()) if c is not None), None)
    if found is None:
        raise KeyError(f"no lever is named {name!r}")
    return found.syntax


def lever_syntax(subgraph: str) -> Optional[LeverSyntax]:
    """The syntax of the lever whose plan name `subgraph` is (in any case), or None for an op plan. Only a registered
    name loads its lever's module."""
    return next((s for s in (r.syntax_of(subgraph) for r in _registries()) if s is not None), None)


@dataclass(frozen=True)
class PlanEntry:
    """One recompute plan: ``subgraph:optimization_type:apply_count``."""

    subgraph: str
    optimization_type: int = 1
    apply_count: int = -1
    layers: str = ""  # the layer selector after '@' ("4-11", "every2", "0+5+9"); "" for the first `apply_count`
    parameter: str = ""  # a lever's parameter ("chunks8", "tiles4"; `LeverSyntax`), "" for its default or an op plan

    def __str__(self) -> str:
        at = ":".join(part for part in (self.layers, self.parameter) if part)
        return f"{self.subgraph}:{self.optimization_type}:{self.apply_count}{'@' if at else ''}{at}"

    def select(self, n_layers: int) -> List[int]:
        """The layers (0-based) this plan applies to in a model of `n_layers` layers; a selector naming a layer the
        model does not have is a PlanError."""
        if not self.layers:
            return list(range(n_layers if self.apply_count == -1 else min(self.apply_count, n_layers)))
        chosen = set()
        for item in self.layers.split("+"):
            low, high, every = _item(item)
            if every:
                chosen.update(range(0, n_layers, every))
                continue
            if high >= n_layers:
                raise PlanError(
                    f"entry {str(self)!r} names layer {high}, but the model has {n_layers} layers (0-{n_layers - 1})"
                )
            chosen.update(range(low, high + 1))
        return sorted(chosen)

    @property
    def enabled(self) -> bool:
        return self.optimization_type != 0 and self.apply_count != 0

    @property
    def key(self) -> str:
        """``subgraph:type``, what identifies a plan regardless of how often it is applied."""
        return f"{self.subgraph}:{self.optimization_type}"

    @property
    def ops(self) -> List[str]:
        return [p for p in self.subgraph.split("+") if p]


def quoted(text: str, limit: int = 60) -> str:
    """`text` quoted as given; a long one (a 5000-digit selector) shortened in the middle, its length said."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit // 2]!r}...{text[-limit // 4 :]!r} ({len(text)} characters)"


def _parse_int(text: str, what: str, expected: str) -> int:
    """An integer written as one in ASCII digits ('1', '-1'); '1.0', 'x', '' or '５' are refused with ``what`` and
    ``expected``, and so is a number of more than `MAX_DIGITS` digits."""
    digits = text.lstrip("+-")
    if digits.isascii() and digits.isdigit() and len(digits) > MAX_DIGITS:
        raise PlanError(f"{what} {quoted(text)}, a number of {len(digits)} digits; {expected}")
    value = int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else None
    if value is None or str(value) != text.lstrip("+"):
        ascii_only = " written in ASCII digits (0-9)" if any(c.isdigit() and not c.isascii() for c in text) else ""
        raise PlanError(f"{what} {quoted(text)}, not an integer{ascii_only}; {expected}")
    return value


def _item(item: str) -> Tuple[int, int, int]:
    """One valid selector item as (first layer, last layer, 0), or (0, -1, k) for `everyk`."""
    one, low, high, every = _ITEM_RE.match(item).groups()
    if every is not None:
        return 0, -1, int(every)
    return (int(one), int(one), 0) if one is not None else (int(low), int(high), 0)


def _selector_problem(item: str) -> Optional[str]:
    """What is wrong with one item of a layer selector (`5`, `4-11`, `every2`), or None."""
    if not item:
        return "an empty item"
    m = _ITEM_RE.match(item)
    if m is None and any(c.isdigit() and not c.isascii() for c in item):
        return f"item {quoted(item)}, whose digits are not ASCII (layer numbers are written 0-9)"
    if m is None:
        return f"item {quoted(item)}"
    longest = max(len(g) for g in m.groups() if g is not None)
    if longest > MAX_DIGITS:
        return f"item {quoted(item)}, a number of {longest} digits (layer numbers have at most {MAX_DIGITS})"
    low, high, every = _item(item)
    if (m.group(4) is None and low > high) or (m.group(4) is not None and every < 1):
        return f"item {quoted(item)}"
    return None


def shared_layer(a: "PlanEntry", b: "PlanEntry") -> Optional[int]:
    """The first layer both entries' `@` selectors name (in any model that has it: a layer number given is one the
    model must have, `everyk` names layer 0 and every k-th), or None where they name none in common. Needs no layer
    count, so plans can be checked when the arguments are built."""
    first = None
    for x in a.layers.split("+"):
        for y in b.layers.split("+"):
            (lo1, hi1, k1), (lo2, hi2, k2) = _item(x), _item(y)
            if k1 and k2:
                found = 0
            elif k1 or k2:
                k, lo, hi = (k1, lo2, hi2) if k1 else (k2, lo1, hi1)
                found = -(-lo // k) * k
                found = found if found <= hi else None
            else:
                found = max(lo1, lo2) if max(lo1, lo2) <= min(hi1, hi2) else None
            if found is not None and (first is None or found < first):
                first = found
    return first


def parse_entry(text: str, allow_zero_count: bool = False) -> PlanEntry:
    """Parse and validate one ``Subgraph+:type:count`` string.

    ``allow_zero_count``: backends write count 0 for a plan they found but did not apply; users may not.
    """
    prefix = f"entry {quoted(text)}"
    text, at, selector = text.partition("@")
    fields = text.split(":")
    if len(fields) != 3:
        raise PlanError(
            f"{prefix} has {len(fields)} ':'-separated field(s); expected 3, "
            f"SubgraphStr:OptimizationType:RequestApplyCount, as in {EXAMPLE!r}"
        )
    subgraph, type_text, count_text = (f.strip() for f in fields)
    if subgraph.lower() == LAYER.lower():
        subgraph = LAYER  # `layer+` is `Layer+`, as `mul+` is `Mul+`
    syntax = lever_syntax(subgraph) if _SUBGRAPH_RE.match(subgraph) else None
    if syntax is not None:
        return _lever_entry(syntax, prefix, type_text, count_text, selector.strip() if at else None)
    for part in _PART_RE.findall(subgraph):
        other = lever_syntax(part) if part != subgraph else None
        if other is not None:
            raise PlanError(
                f"{prefix} names {other.plan!r} with other parts: {other.what} are a plan of their own, not an op of "
                f"a layer; give it as its own entry, as in {f'Gelu+:1:-1,{other.examples[0]}'!r}"
            )
    if not subgraph:
        raise PlanError(f"{prefix} has an empty subgraph; expected a sequence of 'OpName+' parts, as in {EXAMPLE!r}")
    if not _SUBGRAPH_RE.match(subgraph):
        if not subgraph.endswith("+"):
            detail = "does not end with '+'"
        else:
            bad = _PART_RE.sub("", subgraph) or subgraph
            detail = f"has an invalid part {bad!r}"
        raise PlanError(
            f"{prefix} has subgraph {subgraph!r} that {detail}; expected a sequence of 'OpName+' parts "
            f"such as 'Gelu+' or 'Reshape+Where+BiasSoftmax+', as in {EXAMPLE!r}"
        )
    types_expected = f"expected 0 (none), 1 (recompute) or 2 (recompute with compromise), as in {EXAMPLE!r}"
    counts_expected = f"expected -1 (all occurrences) or a positive integer, as in {EXAMPLE!r} or 'Gelu+:1:2'"
    opt_type = _parse_int(type_text, f"{prefix} has optimization type", types_expected)
    if opt_type not in OPTIMIZATION_TYPES:
        raise PlanError(f"{prefix} has optimization type {opt_type}; {types_expected}")
    count = _parse_int(count_text, f"{prefix} has apply count", counts_expected)
    if count < -1 or (count == 0 and not allow_zero_count):
        raise PlanError(f"{prefix} has apply count {count}; {counts_expected}")
    if at:
        selector = _checked_selector(prefix, selector.strip())
        if count != -1:
            raise PlanError(
                f"{prefix} gives both a count ({count}) and layers (@{selector}); give one, as in "
                f"{f'{subgraph}:{opt_type}:-1@{selector}'!r} or {f'{subgraph}:{opt_type}:{count}'!r}"
            )
    return PlanEntry(subgraph, opt_type, count, selector if at else "")


def _lever_entry(
    syntax: LeverSyntax, prefix: str, type_text: str, count_text: str, selector: Optional[str]
) -> PlanEntry:
    """A lever's entry: on (1) or off (0); its layers where it acts in layers (a count, or an `@` selector), else
    count -1; its parameter after the layers (`@0-7:tiles4`) or alone (`@chunks8`, `@tiles4`)."""
    expected = f"expected {syntax.example}"
    name = syntax.plan
    opt_type = _parse_int(type_text, f"{prefix} has optimization type", expected)
    if opt_type not in (0, 1):
        raise PlanError(f"{prefix} has optimization type {opt_type}; `{name}` is 1 (on) or 0 (off): {expected}")
    count = _parse_int(count_text, f"{prefix} has apply count", expected)
    if not syntax.layers and count != -1:
        raise PlanError(
            f"{prefix} has apply count {count}; {syntax.once or 'it acts once a model'}, so `{name}` takes -1 and "
            f"says its {syntax.parameter} after '@': {expected}"
        )
    if syntax.layers and (count < -1 or count == 0):
        raise PlanError(
            f"{prefix} has apply count {count}; expected -1 (every layer) or a positive integer: {expected}"
        )
    layers, parameter = "", ""
    if selector is not None:
        first, colon, last = selector.partition(":")
        if colon:
            layers, parameter = first.strip(), last.strip()
        elif not syntax.layers or (_PARAMETER_RE.match(first.strip()) and not first.lower().startswith("every")):
            parameter = first.strip()
        else:
            layers = _checked_selector(prefix, first.strip())  # an empty one refused, as an op plan's
        if parameter or colon or not syntax.layers:
            bad = syntax.parameter_problem(parameter)
            if bad:
                raise PlanError(f"{prefix} has {bad}, as in {syntax.example}")
            parameter = parameter.lower()
        if (layers or colon) and not syntax.layers:
            raise PlanError(
                f"{prefix} names layers ({quoted(layers)}); {syntax.once or 'it acts once a model'}, so `{name}` "
                f"takes its {syntax.parameter} alone after '@': {expected}"
            )
        if layers or colon:
            layers = _checked_selector(prefix, layers)
            if count != -1:
                raise PlanError(
                    f"{prefix} gives both a count ({count}) and layers (@{layers}); give one, as in "
                    f"{str(PlanEntry(name, opt_type, -1, layers, parameter))!r} or "
                    f"{str(PlanEntry(name, opt_type, count, '', parameter))!r}"
                )
    return PlanEntry(name, opt_type, count, layers, parameter)


def _checked_selector(prefix: str, selector: str) -> str:
    """A layer selector checked item by item, in its one spelling (`@Every2` is `@every2`)."""
    for item in selector.split("+"):
        bad = _selector_problem(item.strip())
        if bad:
            raise PlanError(
                f"{prefix} has layer selector {quoted(selector)} with {bad}; expected layer numbers from 0 (5), "
                f"ranges (4-11), every k-th layer (every2) joined by '+', as in {SELECTOR_EXAMPLE}"
            )
    return "+".join(i.strip().lower() for i in selector.split("+"))


def _check_duplicates(entries: Sequence[PlanEntry]) -> None:
    """A lever that acts once a model named once; every subgraph, whatever its spelling (`mul+` is `Mul+`), by
    `check_named_once`."""
    seen: Dict[str, PlanEntry] = {}
    for entry in entries:
        syntax = lever_syntax(entry.subgraph) if entry.subgraph.lower() in seen else None
        if syntax is not None and not syntax.layers:
            raise PlanError(
                f"names {syntax.plan!r} twice ({str(seen[entry.subgraph.lower()])!r} and {str(entry)!r}); "
                f"{syntax.once or 'it acts once a model'}: give one, as in {syntax.example}"
            )
        seen.setdefault(entry.subgraph.lower(), entry)
    check_named_once(entries)


def check_named_once(
    entries: Sequence[PlanEntry],
    keys: Callable[[PlanEntry], Sequence[str]] = lambda entry: [entry.subgraph.lower()],
    what: str = "subgraph",
) -> None:
    """The grammar's one rule for a thing plans name twice (a subgraph, whatever its spelling; a backend's op,
    whatever name a plan gives it: `keys` of an entry, `what` they are, "subgraph" or "op"):
    only on layers that do not overlap, each entry with its `@` selector, as the solver writes its choices
    (`Mul+:1:-1@0-1,Mul+:1:-1@2-3`). PlanError naming both entries otherwise (tests/test_plans.py,
    tests/test_backend_torch.py's OVERLAPS)."""
    seen: Dict[str, List[PlanEntry]] = {}
    for entry in entries:
        for key in keys(entry):
            for other in seen.get(key, []):
                named = f"subgraph {other.subgraph!r}" if what == "subgraph" else f"the {what} {key!r}"
                twice = f"names {named} twice ({str(other)!r} and {str(entry)!r})"
                once = "Gelu+:1:-1,Cast+:2:-1" if what == "subgraph" else f"{other.subgraph}:1:-1"
                disjoint = f"{other.subgraph}:1:-1@0-1,{entry.subgraph}:1:-1@2-3"
                if not (entry.layers or other.layers):
                    raise PlanError(
                        f"{twice}; give each {what} once, as in {once!r}, or on layers that do not overlap, as in "
                        f"{disjoint!r}"
                    )
                if not (entry.layers and other.layers):
                    raise PlanError(
                        f"{twice}, one of them without a layer selector (its first layers, or all); give both their "
                        f"layers, on layers that do not overlap, as in {disjoint!r}"
                    )
                layer = shared_layer(other, entry)
                if layer is not None:
                    merged = f"{other.subgraph}:{other.optimization_type}:-1@{other.layers}+{entry.layers}"
                    same = other.subgraph.lower() == entry.subgraph.lower()
                    one = f"one entry for all its layers, as in {merged!r}, or " if same else ""
                    raise PlanError(
                        f"{twice}, both on layer {layer}; give each layer's {what} once: {one}entries on layers that "
                        f"do not overlap, as in {disjoint!r}"
                    )
            seen.setdefault(key, []).append(entry)


def parse_inline(text: str) -> List[PlanEntry]:
    """The inline form: comma-separated entries."""
    entries = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        if not part:
            raise PlanError(
                f"value {text!r} has an empty entry at position {i + 1}; separate plans with single commas, "
                f"as in 'Gelu+:1:-1,Cast+:2:-1'"
            )
        entries.append(parse_entry(part))
    _check_duplicates(entries)
    return entries


def parse_cluster_id(cluster_id: str) -> List[PlanEntry]:
    """A backend's cluster id (``Cast+:1:-1,Gelu+:2:0``): the plans it groups, count 0 included."""
    return [parse_entry(p.strip(), allow_zero_count=True) for p in cluster_id.split(",") if p.strip()]


def looks_like_path(value: str) -> bool:
    return value.lower().endswith(".json") or os.sep in value or os.path.exists(value)


def read_json_file(path: str) -> List[PlanEntry]:
    """A JSON file holding a list of plan strings."""
    accepted = 'such as ["Gelu+:1:-1", "Cast+:2:-1"]'
    if not os.path.exists(path):
        raise PlanError(
            f"file {path!r} does not exist; give an existing JSON file holding a list of plans, "
            f"{accepted}, or the plans inline, as in {EXAMPLE!r}"
        )
    if os.path.isdir(path):
        raise PlanError(f"path {path!r} is a directory; expected a JSON file holding a list of plans, {accepted}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(
            f"file {path!r} cannot be read ({e}); expected a readable JSON file holding a list of plans, {accepted}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"file {path!r} is not valid JSON ({e}); expected a list of plans, {accepted}") from None
    if not isinstance(data, list):
        raise PlanError(
            f"file {path!r} holds a JSON {type(data).__name__}, not a list; expected a list of plans, {accepted}"
        )
    if not data:
        raise PlanError(
            f"file {path!r} holds an empty list; list at least one plan, {accepted}, or leave the "
            f"setting out to turn recompute off"
        )
    entries = []
    for i, item in enumerate(data):
        if not isinstance(item, str):
            raise PlanError(
                f"file {path!r} item {i} is {item!r} ({type(item).__name__}), not a string; expected "
                f"plan strings, {accepted}"
            )
        if not item.strip():
            raise PlanError(f"file {path!r} item {i} is an empty string; expected a plan such as {EXAMPLE!r}")
        try:
            entries.append(parse_entry(item.strip()))
        except PlanError as e:
            raise PlanError(f"{e} (in file {path!r})") from None
    try:
        _check_duplicates(entries)
    except PlanError as e:
        raise PlanError(f"{e} (in file {path!r})") from None
    return entries


def parse_plans(value: Optional[Union[str, Sequence[str]]]) -> List[PlanEntry]:
    """Turn a setting's value into validated entries.

    Accepts ``None``/``""`` (off), the inline comma-separated form, a path to a JSON file holding a
    list of plan strings, or an already split list of plan strings.
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
    return parse_inline(value)


def to_inline(entries: Sequence[PlanEntry]) -> str:
    return ",".join(str(e) for e in entries)


def to_json_list(entries: Sequence[PlanEntry]) -> List[str]:
    return [str(e) for e in entries]


# -- the report ------------------------------------------------------------------------------------
HEAD_LEVER = "loss"  # the lever whose rows are the head and its loss' ways (`PlanReport.head_saving_mb`)


@dataclass
class FoundPlan:
    """One recompute opportunity a backend found in the training step."""

    config: str  # the cluster id, in the grammar above
    enabled: bool  # applied in this run
    frequency: int  # occurrences in the graph (transformer layers, usually)
    saving_bytes: Optional[float]  # predicted saving for the first batch, all occurrences
    saving_symbolic: str = ""  # the saving as a formula of the batch's dims, where the backend has one
    applied_count: Optional[int] = None  # occurrences actually recomputed, where the backend can tell
    applied_saving_bytes: Optional[float] = None  # of saving_bytes, what the applied occurrences free, where known
    recompute_seconds: Optional[float] = None  # op time it adds to each backward, measured in the first step
    # a set of plans found (their ops recomputed together, chained), offered as one: its bytes are the set's rows'
    # (counted there, never added to them)
    combination: bool = False
    # how much lower the first step's peak would be with this alone than with nothing recomputed (torch backend:
    # from memory read at each layer's marks); below saving_bytes where the peak would fall outside the layers
    peak_drop_bytes: Optional[float] = None
    # the least and the most that drop can be (the same as peak_drop_bytes where the readings tell it exactly)
    peak_drop_min_bytes: Optional[float] = None
    peak_drop_max_bytes: Optional[float] = None
    # the lever a row belongs to (torch backend: "loss" for the head and its loss' ways, `Loss+`; "mlp" for the MLPs
    # in tiles, `MLP+`), not a plan of the layers' ops; "" for those
    lever: str = ""

    @property
    def entries(self) -> List[PlanEntry]:
        return parse_cluster_id(self.config)

    @property
    def subgraphs(self) -> List[str]:
        return [e.subgraph for e in self.entries]

    def as_request(self) -> str:
        """The plan(s) to request for this opportunity; parts the backend marks with a count of 0 (not applicable
        here) or type 0 are left out."""
        return ",".join(f"{e.subgraph}:{e.optimization_type}:-1" for e in self.entries if e.enabled)


@dataclass
class Unmatched:
    """A requested plan the backend did not find, with the closest plans it did find."""

    requested: str
    closest: List[str] = field(default_factory=list)  # similar plans found, or the largest found when none is
    similar: bool = True
    reason: str = ""  # what the backend knows of why, where it knows

    def message(self, backend: str = "the backend") -> str:
        why = f" ({self.reason})" if self.reason else ""
        if not self.closest:
            return f"requested plan {self.requested!r} matches no plan {backend} found{why}; it found none at all"
        near = ", ".join(repr(c) for c in self.closest)
        what = "closest plans found" if self.similar else "nothing similar; plans found"
        return (
            f"requested plan {self.requested!r} matches no plan {backend} found{why}, so it is not applied; "
            f"{what}: {near}"
        )


@dataclass
class PlanReport:
    """What a backend found and applied, after the first training step."""

    backend: str
    optimizer_enabled: bool
    level: int
    requested: List[str]
    applied: List[str]  # the plan strings the backend was given to apply (its own, at levels 1 / 2)
    plans: List[FoundPlan]
    dims: Dict[str, int] = field(default_factory=dict)  # the first batch's symbolic dims
    unmatched: List[Unmatched] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what else the backend wants the table's reader to know
    peak: str = ""  # where the first step peaked, in a few words ("" where the backend did not follow its memory)
    auto: str = ""  # `auto`'s budget as asked, where the first step ran to measure for it (its choice runs later)
    auto_ran: str = ""  # the dry run's choice the first step ran under `auto` (`from_plan`), where it ran one
    auto_ran_as: str = "a dry run's choice"  # whose choice it is: a dry run's, or `--memory_plan_file`'s
    # the seconds each lever's measurement after the first step took in the run (by lever name), part of its start
    levers_measured_s: Dict[str, float] = field(default_factory=dict)

    @property
    def plans_on(self) -> List[FoundPlan]:
        return [p for p in self.plans if p.enabled]

    def saving_mb(self, enabled_only: bool) -> float:
        """The plans' predicted saving for the first batch: all found (enabled_only=False), or what the applied
        occurrences free (a plan applied to some of its layers counts those layers only, where the backend says)."""

        def applied(p: FoundPlan) -> float:
            return p.applied_saving_bytes if p.applied_saving_bytes is not None else p.saving_bytes or 0.0

        plans = [p for p in self.plans if not p.combination and not p.lever]  # kept bytes; the levers' are a peak's
        if enabled_only:
            return sum(applied(p) for p in plans if p.enabled) / (1024.0 * 1024.0)
        # all found: the plans together, or a combination that chains them and frees more
        alone = sum(p.saving_bytes or 0.0 for p in plans)
        chained = max((p.saving_bytes or 0.0 for p in self.plans if p.combination), default=0.0)
        return max(alone, chained) / (1024.0 * 1024.0)

    def head_saving_mb(self) -> float:
        """What the head and loss, as this run runs them, hold less at their most than the model's own head (the
        `Loss+` row that is on; 0 where none is): a transient peak's bytes, not added to `saving_mb`'s."""
        held_less = sum(p.saving_bytes or 0.0 for p in self.plans if p.lever == HEAD_LEVER and p.enabled)
        return held_less / (1024.0 * 1024.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PlanReport":
        data = dict(data)
        data["plans"] = [FoundPlan(**_lever_of(p)) for p in data.get("plans", [])]
        data["unmatched"] = [Unmatched(**u) for u in data.get("unmatched", [])]
        return cls(**data)


def _lever_of(row: dict) -> dict:
    """A row as `FoundPlan` takes it: a report written before rows named their lever said `head` of every lever's row
    (the head's and the tiled MLP's), told apart here by the plan they run."""
    row = dict(row)
    if "head" in row:
        head = row.pop("head")
        row.setdefault("lever", ("mlp" if row.get("config", "").startswith("MLP+") else HEAD_LEVER) if head else "")
    return row


def match_requests(requested: Sequence[PlanEntry], found: Sequence[FoundPlan], n_closest: int = 3) -> List[Unmatched]:
    """Requested plans that match no found plan (``subgraph:type`` compared exactly, as ORT compares it),
    each with up to ``n_closest`` found plans: same name in another case or type, similar names, or names
    that contain one of its operators (``BiasGelu+`` finds ``Gelu+``)."""
    found_entries = {e.key: e for p in found for e in p.entries if e.enabled}
    out = []
    for entry in requested:
        if not entry.enabled or entry.key in found_entries:
            continue
        keys = sorted(found_entries)
        subgraph_of = {k: found_entries[k].subgraph for k in keys}
        close = [k for k in keys if subgraph_of[k].lower() == entry.subgraph.lower()]
        similar = difflib.get_close_matches(entry.subgraph, sorted(set(subgraph_of.values())), n=n_closest, cutoff=0.5)
        close += [k for s in similar for k in keys if subgraph_of[k] == s and k not in close]
        ops = [o.lower() for o in entry.ops]
        close += [
            k
            for k in keys
            if k not in close
            and any(
                o in found_entries[k].subgraph.lower() or found_entries[k].subgraph.lower().rstrip("+") in o
                for o in ops
            )
        ]
        if close:
            out.append(Unmatched(str(entry), [f"{k}:-1" for k in close[:n_closest]]))
        else:  # the backend's order: largest predicted saving first
            out.append(Unmatched(str(entry), [f"{k}:-1" for k in list(found_entries)[:n_closest]], similar=False))
    return out
