"""What a causal LM's training forward does from its backbone's last hidden states to its loss, read from the
forward's own source (`head_form`): recognised by structure, not by the family's name.

The form the loss lever (`Loss+`) can run in chunks:

    outputs = self.<backbone>(...)                        # the model's backbone (`base_model_prefix`)
    hidden_states = outputs.last_hidden_state             # or `outputs[0]`
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)  # or `[:, slice_indices, :]`
    logits = <an expression of the hidden states that calls the output embeddings>   # the head
    <statements on the logits alone>                      # a soft cap, a scale, a vocabulary cut, `.float()`
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, <vocabulary>, **kwargs)
    ... loss += <an expression of the output's fields>   # under `if labels is not None` (an MoE's aux loss)

The head and the statements on the logits become one function of the hidden states (`HeadForm.logits`), which the
lever runs on each chunk of rows: every statement in it is row-wise, as the check of the names it reads makes sure
(the logits, `self`, the module's globals, and names it sets itself). What the forward adds to the loss after it
(`loss += self.router_aux_loss_coef * aux_loss.to(loss.device)`) becomes `HeadForm.add_to`, run on the output of the
forward called without labels (whose fields hold `aux_loss`), so the lever's loss is the model's, aux loss and its
gradient included. Anything else (another loss, a shift written out, a head over several positions' states, a
forward without `logits_to_keep`) is refused with the statement that differs.
"""

import ast
import builtins
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple, Union

from torch import nn


@dataclass
class HeadForm:
    """A forward's head and loss as the lever runs them. `logits(lm, hidden)`: the head and what the forward does to
    the logits before the loss; `additions`: what it adds to the loss after (each a function of the model, the loss
    and the output's fields it reads, and those fields' names); `between` and `added`: their source, for notes."""

    logits: Callable
    additions: List[Tuple[Callable, Tuple[str, ...]]] = field(default_factory=list)
    between: List[str] = field(default_factory=list)
    added: List[str] = field(default_factory=list)
    bare: bool = True  # the head is a bare call of the output embeddings, nothing done to its logits

    def add_to(self, lm: nn.Module, loss, out):
        """The loss with what the forward adds to it (an MoE's aux loss), where the output holds what it reads: as
        the forward adds it (under `if output_router_logits`, `aux_loss` is None when off)."""
        for add, names in self.additions:
            values = [getattr(out, n, None) for n in names]
            if all(v is not None for v in values):
                loss = add(lm, loss, *values)
        return loss


def head_form(lm: nn.Module) -> Union[HeadForm, str]:
    """`lm`'s form (`HeadForm`), or why the lever cannot run its forward in chunks."""
    head = lm.get_output_embeddings()
    names = [n for n, m in lm.named_children() if m is head]
    if not names:
        return f"its output embeddings are not one of its own modules ({type(head).__name__})"
    return _form_of(type(lm), names[0], getattr(lm, "base_model_prefix", "model"))


@functools.lru_cache(maxsize=None)
def _form_of(cls: type, head: str, backbone: str) -> Union[HeadForm, str]:
    forward = inspect.unwrap(cls.forward)
    if "logits_to_keep" not in inspect.signature(forward).parameters:
        return "its forward takes no `logits_to_keep`, which the lever needs to leave the head out of the forward"
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError) as e:
        return f"the source of its forward cannot be read ({e})"
    fn = ast.parse(source).body[0]
    return _Reader(fn, head, backbone, forward.__globals__, _backbone_class(cls, backbone)).read()


def _backbone_class(cls: type, backbone: str) -> Optional[type]:
    """The class `cls.__init__` builds its backbone from (`self.model = Gemma3Model(config)`), read from its source
    and looked up in its module, or None."""
    try:
        init = inspect.unwrap(cls.__init__)
        fn = ast.parse(textwrap.dedent(inspect.getsource(init))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Attribute)
            and node.targets[0].attr == backbone
            and _is_name(node.targets[0].value, "self")
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
        ):
            found = init.__globals__.get(node.value.func.id)
            return found if isinstance(found, type) else None
    return None


class _Reader:
    def __init__(self, fn: ast.FunctionDef, head: str, backbone: str, module_globals: dict, backbone_cls=None):
        self.body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        self.head, self.backbone, self.globals = head, backbone, module_globals
        self.backbone_cls = backbone_cls  # the backbone's class, where known (`_backbone_class`)
        self.known = set(module_globals) | set(dir(builtins))

    def read(self) -> Union[HeadForm, str]:
        at = next((i for i, s in enumerate(self.body) if self._is_head(s)), None)
        if at is None:
            return f"no statement of its forward sets the logits from `self.{self.head}` (its output embeddings)"
        statement = self.body[at]
        logits, value = statement.targets[0].id, statement.value
        hidden = self._head_input(value)
        if isinstance(hidden, str) and hidden.startswith("!"):
            return hidden[1:]
        problem = self._hidden_from_backbone(hidden, at)
        if problem:
            return problem
        value = _Replace(self._sliced).visit(value)  # `hidden_states[:, slice_indices, :]`: the rows given
        ends = next((i for i in range(at + 1, len(self.body)) if _sets_none(self.body[i], "loss")), None)
        if ends is None:
            return "its forward sets no `loss = None` after the head"
        between = self.body[at + 1 : ends]
        made = {logits}
        for s in between:
            problem = self._row_wise(s, made | {"self"})
            if problem:
                return problem
            made |= _assigned(s)
        check = self.body[ends + 1] if ends + 1 < len(self.body) else None
        problem = self._loss_call(check, logits) or self._labels_for_the_loss_only(ends + 1)
        if problem:
            return problem
        additions, added = [], []
        fields = self._output_fields()
        for s in self.body[ends + 2 :]:
            for node, guarded in _loss_changes(s):
                text = ast.unparse(node)
                if not guarded:
                    return f"its forward changes the loss outside `if labels is not None` (`{text}`)"
                reads = _reads(node) - {"self", "loss"}
                missing = sorted(n for n in reads if n not in fields and n not in self.known)
                if missing:
                    return f"its forward adds to the loss what its output does not hold (`{text}`: {missing})"
                names = tuple(sorted(n for n in reads if n in fields))
                additions.append((self._compile_addition(node, names), names))
                added.append(text)
        compiled = self._compile_logits(hidden, logits, value, between)
        bare = not between and _is_bare_call(value, self.head)
        return HeadForm(compiled, additions, [ast.unparse(s) for s in between], added, bare)

    # -- the head and its input -------------------------------------------------------------------------------

    def _is_head(self, s: ast.stmt) -> bool:
        return (
            isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and isinstance(s.targets[0], ast.Name)
            and any(_calls_self(n, self.head) for n in ast.walk(s.value))
        )

    def _head_input(self, value: ast.expr) -> str:
        """The name of the hidden states the head's expression reads (with `self` and the module's globals)."""
        reads = _reads(value) - {"self"} - self.known
        reads -= {"slice_indices", "logits_to_keep"}
        if len(reads) != 1:
            shown = sorted(reads) or "nothing"
            return f"!the head's expression reads {shown} (`{ast.unparse(value)}`), not one tensor"
        return next(iter(reads))

    def _sliced(self, node: ast.AST) -> Optional[ast.AST]:
        """`x[:, slice_indices, :]` (the older forwards' slice): `x`."""
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return node.value if "slice_indices" in _reads(node.slice) else None
        return None

    def _hidden_from_backbone(self, hidden: str, at: int) -> Optional[str]:
        """Whether `hidden` is the backbone's last hidden states, sliced by `logits_to_keep` at most."""
        outputs = None
        for s in self.body[:at]:
            if isinstance(s, (ast.Assign, ast.AnnAssign)) and isinstance(s.value, ast.Call):
                target = s.targets[0] if isinstance(s, ast.Assign) else s.target
                if _calls_self(s.value, self.backbone) and isinstance(target, ast.Name):
                    outputs = target.id
        if outputs is None:
            return f"its forward does not call its backbone (`self.{self.backbone}(...)`) before the head"
        seen = False
        for s in self.body[:at]:
            if hidden not in _assigned(s):
                continue
            if not isinstance(s, ast.Assign):
                return f"its forward sets the head's input in `{ast.unparse(s)}`"
            value = s.value
            last = isinstance(value, ast.Attribute) and value.attr == "last_hidden_state"
            first = isinstance(value, ast.Subscript) and ast.unparse(value.slice) == "0"
            from_outputs = (last or first) and _is_name(value.value, outputs)
            sliced = (
                isinstance(value, ast.Call)
                and ast.unparse(value.func).endswith("slice_logits_to_keep")
                and [ast.unparse(a) for a in value.args] == [hidden, "logits_to_keep"]
            ) or (self._sliced(value) is not None and _is_name(self._sliced(value), hidden))
            if from_outputs:
                seen = True
            elif not (seen and sliced):
                return f"the head's input is not the backbone's last hidden states (`{ast.unparse(s)}`)"
        return None if seen else f"the head's input `{hidden}` is not the backbone's output"

    # -- after the head ------------------------------------------------------------------------------------------

    def _row_wise(self, s: ast.stmt, names: Set[str]) -> Optional[str]:
        """A statement between the head and the loss: it may read the logits, `self`, the module's globals and what
        such statements set, and set plain names only."""
        for node in ast.walk(s):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if not all(isinstance(t, ast.Name) for t in targets):
                    return f"its forward sets more than names between the head and the loss (`{ast.unparse(s)}`)"
        reads = _reads(s) - names - self.known - _assigned(s)
        if reads:
            return (
                f"between the head and the loss its forward reads {sorted(reads)} "
                f"(`{ast.unparse(s).splitlines()[0]}`), more than the logits"
            )
        return None

    def _loss_call(self, s: Optional[ast.stmt], logits: str) -> Optional[str]:
        expected = f"`if labels is not None: loss = self.loss_function({logits}, labels, ..., **kwargs)`"
        if not (isinstance(s, ast.If) and ast.unparse(s.test) == "labels is not None" and not s.orelse):
            return f"its loss is not computed as {expected}"
        if len(s.body) != 1 or not isinstance(s.body[0], ast.Assign):
            return f"its loss is computed in more than one statement (`{ast.unparse(s).splitlines()[1].strip()}`)"
        call = s.body[0].value
        if not (_is_name(s.body[0].targets[0], "loss") and _calls_self(call, "loss_function")):
            return f"its loss is `{ast.unparse(s.body[0])}`, not the model's `self.loss_function`"
        given = [ast.unparse(a) for a in call.args]
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        first = keywords.get("logits", given[0] if given else None)
        second = keywords.get("labels", given[1] if len(given) > 1 else None)
        if (first, second, keywords.get(None)) != (logits, "labels", "kwargs"):
            return f"its loss is `{ast.unparse(s.body[0])}`, not {expected}"
        return None

    def _labels_for_the_loss_only(self, loss_at: int) -> Optional[str]:
        """The lever calls the forward without labels: where the forward reads them for more than its loss (and the
        additions to it, under `if labels is not None`), that forward would not be the one the model runs."""
        for i, s in enumerate(self.body):
            if i == loss_at:
                continue
            for node in _outside_label_guards(s):
                if "labels" in _reads(node) and not self._labels_to_a_backbone_that_ignores_them(node):
                    return f"its forward reads `labels` besides its loss (`{ast.unparse(node).splitlines()[0]}`)"
        return None

    def _labels_to_a_backbone_that_ignores_them(self, node: ast.AST) -> bool:
        """`outputs = self.model(..., labels=labels, ...)` where the backbone's forward takes them and reads them
        nowhere (Gemma 3's): without labels that forward is the same."""
        value = getattr(node, "value", None)
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and _calls_self(value, self.backbone)):
            return False
        if any("labels" in _reads(a) for a in value.args) or any(
            "labels" in _reads(k.value) and not (k.arg == "labels" and _is_name(k.value, "labels"))
            for k in value.keywords
        ):
            return False
        backbone = self.backbone_cls
        if backbone is None:
            return False
        try:
            fn = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(backbone.forward)))).body[0]
        except (OSError, TypeError, SyntaxError):
            return False
        return not any("labels" in _reads(s) for s in fn.body)

    def _output_fields(self) -> Set[str]:
        """The names the forward's return passes to its output by the same name (`aux_loss=aux_loss`)."""
        fields = set()
        for s in self.body:
            if isinstance(s, ast.Return) and isinstance(s.value, ast.Call):
                fields |= {k.arg for k in s.value.keywords if k.arg and _is_name(k.value, k.arg)}
        return fields

    # -- compiled --------------------------------------------------------------------------------------------

    def _compile_logits(self, hidden: str, logits: str, value: ast.expr, between: List[ast.stmt]) -> Callable:
        head = ast.Assign(targets=[ast.Name(logits, ast.Store())], value=value)
        body = [head, *between, ast.Return(ast.Name(logits, ast.Load()))]
        return self._compile("_memopt_head", ["self", hidden], body)

    def _compile_addition(self, node: ast.stmt, names: Tuple[str, ...]) -> Callable:
        return self._compile("_memopt_add", ["self", "loss", *names], [node, ast.Return(ast.Name("loss", ast.Load()))])

    def _compile(self, name: str, args: List[str], body: List[ast.stmt]) -> Callable:
        fn = ast.FunctionDef(
            name=name,
            args=ast.arguments(
                posonlyargs=[], args=[ast.arg(a) for a in args], kwonlyargs=[], kw_defaults=[], defaults=[]
            ),
            body=body,
            decorator_list=[],
            returns=None,
            type_params=[],
        )
        module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
        space: Dict[str, object] = {}
        exec(compile(module, f"<optimum_memopt: {name}>", "exec"), self.globals, space)
        return space[name]


class _Replace(ast.NodeTransformer):
    def __init__(self, replace: Callable[[ast.AST], Optional[ast.AST]]):
        self.replace = replace

    def visit(self, node):
        found = self.replace(node)
        if found is not None:
            return ast.Name(found.id, ast.Load())
        return self.generic_visit(node)


def _calls_self(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and _is_name(node.func.value, "self")
    )


def _is_bare_call(value: ast.expr, head: str) -> bool:
    return _calls_self(value, head) and len(value.args) == 1 and isinstance(value.args[0], ast.Name)


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _sets_none(s: ast.stmt, name: str) -> bool:
    return (
        isinstance(s, ast.Assign)
        and len(s.targets) == 1
        and _is_name(s.targets[0], name)
        and isinstance(s.value, ast.Constant)
        and s.value.value is None
    )


def _reads(node: ast.AST) -> Set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _assigned(node: ast.AST) -> Set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
    return out


def _outside_label_guards(s: ast.stmt):
    """`s`'s parts outside any `if labels is not None` (its test and its body left out), each a node to read."""
    if isinstance(s, ast.If) and ast.unparse(s.test) == "labels is not None":
        for child in s.orelse:
            yield from _outside_label_guards(child)
        return
    if isinstance(s, ast.If):
        yield s.test
        for child in s.body + s.orelse:
            yield from _outside_label_guards(child)
        return
    if isinstance(s, (ast.For, ast.While, ast.With, ast.Try)):
        for child in ast.iter_child_nodes(s):
            if isinstance(child, ast.stmt):
                yield from _outside_label_guards(child)
            else:
                yield child
        return
    yield s


def _loss_changes(s: ast.stmt, guarded: bool = False):
    """The statements in `s` that set `loss` (`loss += ...`, `loss = ...`), each with whether an enclosing `if labels
    is not None` guards it (the lever calls the forward without labels, so a guarded change has not run)."""
    if isinstance(s, (ast.Assign, ast.AugAssign)):
        targets = s.targets if isinstance(s, ast.Assign) else [s.target]
        if any(_is_name(t, "loss") for t in targets):
            yield s, guarded
        return
    if isinstance(s, ast.If):
        inner = guarded or ast.unparse(s.test) == "labels is not None"
        for child in s.body:
            yield from _loss_changes(child, inner)
        for child in s.orelse:
            yield from _loss_changes(child, guarded)
        return
    for child in ast.iter_child_nodes(s):
        if isinstance(child, ast.stmt):
            yield from _loss_changes(child, guarded)
