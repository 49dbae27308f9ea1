"""The processes that choose one recompute policy together (`planner`): one rank decides, the others follow."""

import torch
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

    def most(self, value: int) -> tuple:
        """(the highest of every rank's `value`, the first rank that has it), on every rank: one all-reduce of one
        integer on the group's device (no object pickled: it runs at every step's start), where that device is known
        (Gloo's, the CPU; NCCL's, the current GPU), else through `gather`."""
        if self.size == 1 or self.mirrored:
            return value, self.rank
        backend = str(self._dist.get_backend())
        if "gloo" in backend:  # "gloo", or "cpu:gloo,cuda:nccl"
            device = torch.device("cpu")
        elif backend == "nccl" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            offers = self.gather(value)
            return max(offers), offers.index(max(offers))
        # the value and the rank in one integer: the most of the first, then the lowest rank among equals
        packed = torch.tensor([value * self.size + self.size - 1 - self.rank], dtype=torch.int64, device=device)
        self._dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        top = int(packed.item())
        return top // self.size, self.size - 1 - top % self.size

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
