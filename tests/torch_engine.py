"""Tiny models for the torch engine's op-level tests: a stack of blocks, each running a function of its input and
its own weight, so a test states the ops of a layer in one line."""

import copy

import torch
from torch import nn

from optimum_memopt.backends.torch.backend import TorchBackend
from optimum_memopt.backends.torch.policy import LayerPolicy, RecomputePolicy

D = 8


class Block(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


class Stack(nn.Module):
    def __init__(self, fn, n=1):
        super().__init__()
        self.layers = nn.ModuleList([Block(fn) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def pair(fn, n=1, seed=0):
    """Two equal stacks: one to run plainly, one for the engine."""
    torch.manual_seed(seed)
    plain = Stack(fn, n)
    return plain, copy.deepcopy(plain)


def keep(n=1):
    return RecomputePolicy([LayerPolicy() for _ in range(n)])


def ops(*names, n=1):
    return RecomputePolicy([LayerPolicy.of_ops({nm: f"{nm}+:1:-1" for nm in names}) for _ in range(n)])


def engine(model, policy):
    """The model under `policy`; returns its engine state (profile filled by the first training forward)."""
    TorchBackend().apply_policy(model, policy)
    return model._memopt_recompute


def step(model, x, seed=0):
    """One training forward and backward; the input's and the weights' gradients."""
    model.train()
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    model(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


class Counting:
    """A user's saved-tensor hooks around the step: counts what it is given."""

    def __init__(self):
        self.tensors, self.nbytes = 0, 0

    def __enter__(self):
        def pack(t):
            self.tensors += 1
            self.nbytes += t.numel() * t.element_size()
            return t

        self._cm = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
