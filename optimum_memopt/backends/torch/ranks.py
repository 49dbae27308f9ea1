"""The processes that choose one recompute policy together (`planner`): one rank decides, the others follow."""

import torch.distributed as dist


class Ranks:
    """The processes that choose together: the default process group where one with several processes is up, else
    this process alone. Every call is a collective: every rank makes it, at the same point of the same step."""

    def __init__(self, alone: bool = False):
        self._dist = dist
        # `alone`: this process for itself (a dry run of its own step, inside a launch of several: `from_plan`)
        self.size = dist.get_world_size() if not alone and dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.size > 1 else 0
        # a dry run's fake process group (`fake_step`): one process runs rank 0's step for all of them, and
        # every rank's figures are its own (its collectives move nothing: an object sent through one is lost)
        self.mirrored = self.size > 1 and dist.get_backend() == "fake"

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        if self.mirrored:
            return [obj] * self.size
        out = [None] * self.size
        self._dist.all_gather_object(out, obj)
        return out

    def from_rank0(self, obj):
        """Rank 0's `obj` on every rank."""
        return self.from_rank(obj, 0)

    def from_rank(self, obj, src: int):
        """Rank `src`'s `obj` on every rank."""
        if self.size == 1 or self.mirrored:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=src)
        return box[0]
