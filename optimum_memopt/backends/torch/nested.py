"""The tensors in nested arguments (an op's, a forward's: lists, tuples and dicts), and the same arguments with
each tensor replaced: what the engine, the tracker and the readings share."""

from typing import List

import torch


def tensors_in(value) -> List[torch.Tensor]:
    """The tensors in an op's arguments (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def map_tensors(value, fn):
    """`value` (an op's arguments: nested lists, tuples and dicts) with each tensor replaced by `fn(tensor)`, in the
    order `tensors_in` lists them."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def map_instances(value, kind: type, fn):
    """`value` (nested lists, tuples and dicts) with each instance of `kind` replaced by `fn(it)`."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_instances(v, kind, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_instances(v, kind, fn) for k, v in value.items()}
    return value
