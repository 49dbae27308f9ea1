"""Model changes a backend needs before it can wrap a model, made in place and reported."""

from torch import nn


def use_eager_attention(model: nn.Module) -> bool:
    """Switch SDPA attention modules to their eager parent class in place.

    ORT 1.19's gradient builder fails on the graph the SDPA path exports (BERT / RoBERTa), while the
    eager path trains. The SDPA classes subclass the eager ones without new state, so the switch keeps
    every parameter. Returns True when something was switched.
    """
    switched = False
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        config._attn_implementation = "eager"
        switched = True
    for module in model.modules():
        cls = type(module)
        if "Sdpa" in cls.__name__ and len(cls.__mro__) > 1:
            parent = cls.__mro__[1]
            if parent is not nn.Module and "Sdpa" not in parent.__name__:
                module.__class__ = parent
                switched = True
        if getattr(module, "attn_implementation", None) == "sdpa":
            module.attn_implementation = "eager"
            switched = True
    return switched
