"""What the offload lever weighs its options by, read after step one, and its options for the solver.

Measured (`measure`): the link between the device and the host (on a card, copies of pinned host memory timed each
way; in a dry run for a card, the card's link as the device table gives it: `planning.devices.Device.host_link`) and
the host memory the copies may hold (`--memory_host_mb`, or what the host has available as step one ends), shared
evenly by the processes of the run on that machine (`LOCAL_WORLD_SIZE`, as torchrun and accelerate set it: each
offloads its own step's). On the CPU the host is the device: a copy there holds as much as it lets go of, and the
lever offers nothing.

The options (`choices`), each on layers recomputed whole (`LeverChoice.recomputed`), whose checkpoints save the
layers' arguments alone:

- Which layers: the first `k`, for a few `k` up to every layer. A layer's tensors wait on the host from the end of
  its forward to the backward of the layer `ahead` layers after it; the first layers' wait longest, through every
  segment a step's peak can fall in (the last layers' forward, the head, the first backwards).
- What it holds less: layer `i`'s first argument (the hidden states the layer before made; `LayerProfile.input_bytes`),
  in every later layer's forward from where the model's own code lets go of it (a decoder's loop, as the next layer
  starts; Llama's forward keeps the first layer's in a local until the layers end: `LayerProfile.input_gone_at`, seen
  in a dry run's forward before step one), the head, and the backward of each layer more than `ahead` after it.
  Its other arguments (the positions' embeddings, a mask) are held by the model for every layer: copied, freed
  nowhere.
- What it costs: the copies run on a stream of their own, out while the next layer's forward runs and back while the
  `ahead` layers after it run their backward (a layer recomputed whole: its forward again and its backward, three of
  its forwards' time); only what the copies take past that compute costs (`LeverChoice.cost`). Both summed over the
  layers offloaded: the copies queue on one stream, in order.
- What the host holds: every argument of each layer offloaded (`LayerProfile.arguments_bytes`), an upper figure; an
  option whose copies do not fit the host memory measured is not offered, and the notes say so.
"""

import os
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .....memory import MIB
from .....plans import LeverOption
from ...decide.budget import LeverChoice
from ...measure.aside import held_aside
from ...measure.profile import HEAD_PLACE, INPUT_KEPT, Place
from ...measure.storages import counting
from .option import DEFAULT_AHEAD, SYNTAX, layer_option

HOST_IS_DEVICE = "the host is the device here (the CPU): a copy to it holds as much as it lets go of"
LINK_PROBE_BYTES = 64 * MIB  # the copy timed each way on a card
LINK_REPEATS = 3
SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1)  # the first layers offloaded, as shares of the layers


@dataclass
class OffloadMeasure:
    """What the lever weighs its options by (pure data, `profile.levers["offload"]`)."""

    link: float  # bytes/s each way between the device and the host (the slower way)
    link_how: str  # how it was found, in words
    host_room: int  # the bytes the copies may hold on the host
    host_how: str  # where that figure comes from, in words
    not_offered: Tuple[str, ...] = ()  # options left out, each with why (the table's notes)
    ran: Tuple[Tuple[int, int], ...] = ()  # what the measured step offloaded: (layer, ahead), its options' baseline


def host_available() -> Optional[int]:
    """The host memory available now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure(device: str, host_mb: Optional[float], resets: bool = True):
    """The link and the host's room (`OffloadMeasure`), or why the lever offers nothing here (a string). On a card the
    copies are timed aside (`aside.held_aside`: unseen by the step's readings; `resets` as it takes it)."""
    count = counting()
    if count is not None and count.host_link is not None:  # a dry run for a card: the card's link, from the table
        link, how = count.host_link[0], f"the device table's link: {count.host_link[1]}"
    elif count is not None or device != "cuda":
        return HOST_IS_DEVICE
    else:
        timed: list = []
        held_aside(lambda: timed.append(_timed_link()), device, resets)
        link, how = timed[0]
    if host_mb is not None:
        room, where = int(host_mb * MIB), f"`--memory_host_mb {host_mb:g}`"
    else:
        room = host_available()
        if room is None:
            return "the host's available memory could not be read (no /proc/meminfo): give `--memory_host_mb`"
        where = (
            "this machine's available memory (MemAvailable) as step one ended; `--memory_host_mb` gives the training "
            "machine's"
            if count is not None
            else "the host's available memory (MemAvailable) as step one ended"
        )
    local = local_processes()
    if local > 1:
        room //= local
        where += f", shared by the {local} processes on this machine ({room / MIB:,.0f} MiB each)"
    return OffloadMeasure(link, how, room, where)


def local_processes() -> int:
    """The processes of the run on this machine (`LOCAL_WORLD_SIZE`, as torchrun and accelerate set it; 1 unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _timed_link() -> Tuple[float, str]:
    """A card's link to the host, timed: a pinned buffer copied each way, the median of a few, the slower way."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    card = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    rates = []
    for into, out_of in ((host, card), (card, host)):
        into.copy_(out_of, non_blocking=True)  # once untimed
        torch.cuda.synchronize(device)
        seconds = []
        for _ in range(LINK_REPEATS):
            began = time.perf_counter()
            into.copy_(out_of, non_blocking=True)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - began)
        rates.append(LINK_PROBE_BYTES / statistics.median(seconds))
    link = min(rates)
    return link, f"timed: {LINK_PROBE_BYTES // MIB} MiB of pinned memory copied each way, {link / 1e9:,.1f} GB/s"


def layer_sets(n_layers: int) -> List[int]:
    """How many of the first layers each option offloads: a few shares of them, every layer last."""
    return sorted({max(1, round(share * n_layers)) for share in SHARES}) if n_layers else []


def choices(profile, measured: OffloadMeasure, ahead: int = DEFAULT_AHEAD) -> List[LeverChoice]:
    """The options the solver weighs (see the module's docstring), off first; those whose copies do not fit the
    host's room left out (`OffloadMeasure.not_offered` says which). Each holds less than what the measured step
    offloaded (`OffloadMeasure.ran`; most often nothing)."""
    layers = profile.layers
    n = len(layers)
    ran = dict(measured.ran)
    if any(i >= n or layers[i].graph is None or not layers[i].input_bytes for i in ran):
        return [LeverChoice(SYNTAX.name, None if not ran else _ran_option(ran, n), recomputed=tuple(sorted(ran)))]
    base = _less(profile, ran)
    out = [_choice(profile, {}, base, 0.0, None)]
    skipped = []
    for k in layer_sets(n):
        chosen = list(range(k))
        if any(layers[i].graph is None or not layers[i].input_bytes for i in chosen):
            break  # a layer not read in step one: nothing it would hold less is known, nor for any set holding it
        host = sum(layers[i].arguments_bytes for i in chosen)
        option = layer_option(chosen, ahead, n)
        if host > measured.host_room:
            skipped.append(
                f"{SYNTAX.plan_of(option)}: its copies would hold up to {host / MIB:,.0f} MiB on the host, "
                f"{measured.host_how} is {measured.host_room / MIB:,.0f} MiB"
            )
            continue
        out.append(_choice(profile, {i: ahead for i in chosen}, base, measured.link, option))
    measured.not_offered = tuple(skipped)
    return out


def _ran_option(ran: Dict[int, int], n: int):
    """The option the measured step ran, as the policy holds it."""
    by_ahead: Dict[int, List[int]] = {}
    for i, a in sorted(ran.items()):
        by_ahead.setdefault(a, []).append(i)
    return LeverOption(tuple(part for a, layers in by_ahead.items() for part in layer_option(layers, a, n).parts))


def _less(profile, chosen: Dict[int, int]) -> Dict[Place, int]:
    """What offloading `chosen` (layer -> ahead) holds less than offloading nothing, by segment: each layer's input in
    every later layer's forward from where the model's code lets go of it (`LayerProfile.input_gone_at`: the next
    layer's, unless seen later), the head where it is let go of by then, and the backward of each layer more than
    `ahead` after it."""
    layers = profile.layers
    n = len(layers)
    less: Dict[Place, int] = {}
    for i, ahead in chosen.items():
        held = layers[i].input_bytes
        gone = layers[i].input_gone_at
        gone = i + 1 if gone is None else (n + 1 if gone == INPUT_KEPT else max(gone, i + 1))
        for j in range(gone, n):
            less[Place.forward(j)] = less.get(Place.forward(j), 0) + held
        if gone <= n:
            less[HEAD_PLACE] = less.get(HEAD_PLACE, 0) + held
        for j in range(i + ahead + 1, n):
            less[Place.backward(j)] = less.get(Place.backward(j), 0) + held
    return less


def _choice(profile, chosen: Dict[int, int], base: Dict[Place, int], link: float, option) -> LeverChoice:
    """The option offloading `chosen` (layer -> ahead), against the measured step's offload (`base`: what it held
    less than none)."""
    layers = profile.layers
    n = len(layers)
    mine = _less(profile, chosen)
    less = {p: mine.get(p, 0) - base.get(p, 0) for p in set(mine) | set(base)}
    copies = window = 0.0
    for i, ahead in chosen.items():
        copies += 2 * layers[i].input_bytes / link  # out, and back
        if i + 1 < n:  # out under the next layer's forward, back under the backward of the `ahead` after it
            window += layers[i + 1].op_seconds
        window += sum(3 * layers[j].op_seconds for j in range(i + 1, min(n, i + ahead + 1)))
    return LeverChoice(
        SYNTAX.name,
        option,
        SYNTAX.plan_of(option),
        tuple((p, b) for p, b in less.items() if b),
        overlap_seconds=copies,
        window_seconds=window,
        recomputed=tuple(sorted(chosen)),
    )
