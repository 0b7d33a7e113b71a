"""A scenario: one model on one piece of hardware with one training configuration."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Callable, TypeVar

from . import arch, policy
from .specs import Assumptions, Hardware, ModelSpec, TrainSpec
from .units import ceil_div

T = TypeVar("T")


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    hw: Hardware
    train: TrainSpec
    assume: Assumptions = field(default_factory=Assumptions)
    shard_size: int | None = None  # HSDP shard group; default one node
    custom_units: tuple[arch.Unit, ...] | None = None  # a model that is not a decoder (reference)

    @cached_property
    def units(self) -> list[arch.Unit]:
        if self.custom_units is not None:
            return list(self.custom_units)
        t = self.train
        return list(arch.units(self.model, t.blocks_per_unit, t.embed_head_unit, t.layout))

    @cached_property
    def params(self) -> int:
        return arch.param_count(self.model)

    @property
    def n(self) -> int:
        return self.hw.num_gpus

    @property
    def hsdp_shard(self) -> int:
        if self.shard_size is not None:
            return self.shard_size
        return min(self.hw.cluster.gpus_per_node, self.n)

    def shard_degree(self, hsdp: bool) -> int:
        return self.hsdp_shard if hsdp else self.n

    def shard_elems(self, unit: arch.Unit, degree: int) -> int:
        """Elements each rank holds of one unit.

        zero layout (DeepSpeed): the unit's flat buffer padded to a multiple of the degree.
        torch layout (FSDP2): each parameter is split on dim 0, padded to a multiple of the degree
        (a 3-D expert weight on more ranks than experts: on dim 1, arch.fsdp_shard_elems).
        """
        if self.train.layout == "zero" or degree == 1:
            return ceil_div(unit.numel, degree)
        known = unit.dim0_shards.get((degree, self.n))  # the world decides an expert's placement
        if known is None:
            known = unit.dim0_shards[(degree, self.n)] = _dim0_shard(unit.shapes, degree, self.n)
        return known

    def padded_elems(self, unit: arch.Unit, degree: int) -> int:
        """The unit's gathered size including padding: what one all-gather moves."""
        return self.shard_elems(unit, degree) * degree

    def for_strategy(self, fsdp: bool) -> "Scenario":
        """The scenario a strategy is priced on: `embed_head_unit` groups FSDP's units, and a
        strategy that shards no parameters (DDP, ZeRO-1) has none, so it sees the separate ones; in
        the torch layout it runs under autocast where the param dtype is below the master dtype
        (`TrainSpec.autocast`). One per scenario and `fsdp`, made once (recommend asks often)."""
        return self._strategy_views[fsdp]

    @cached_property
    def _strategy_views(self) -> dict[bool, "Scenario"]:
        return {fsdp: self._priced_for(fsdp) for fsdp in (False, True)}

    def _priced_for(self, fsdp: bool) -> "Scenario":
        t = self.train
        p = t.precision
        autocast = policy.autocast_dtype(fsdp, t.layout, p.param, p.master) is not None
        if (fsdp or t.embed_head_unit == "separate") and autocast == t.autocast:
            return self
        update = {"autocast": autocast} if fsdp else {"embed_head_unit": "separate", "autocast": autocast}
        return replace(self, train=t.model_copy(update=update))


class PinnedMemo:
    """A bounded memo (cleared whole when full) whose keys may name an unhashable spec by its id
    (the GPU spec holds dicts): each entry keeps that spec (`pin`) alive, so its id cannot be
    reused while the entry is kept, and a hit must hold the same object."""

    def __init__(self, limit: int = 4096):
        self._entries: dict[tuple, tuple[object, object]] = {}
        self._limit = limit

    def get(self, key: tuple, pin: object, make: Callable[[], T]) -> T:
        hit = self._entries.get(key)
        if hit is not None and hit[0] is pin:
            return hit[1]
        value = make()
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = (pin, value)
        return value


class SegmentFreeMemo:
    """A memo of results that depend on a scenario but not on the allocator's segment kind
    (Assumptions.expandable_segments changes only what is reserved): a step's events, traffic and
    time. recommend's second search, under expandable segments, and estimate's full estimate after
    its fit test ask for them again. The hardware spec counts by identity (PinnedMemo)."""

    def __init__(self, limit: int = 4096):
        self._memo = PinnedMemo(limit)

    def get(self, sc: Scenario, extra: object, make: Callable[[], T]) -> T:
        a = sc.assume
        if a.expandable_segments:
            a = a.model_copy(update={"expandable_segments": False})
        key = (sc.model, id(sc.hw), sc.train, a, sc.shard_size, sc.custom_units, extra)
        return self._memo.get(key, sc.hw, make)


@lru_cache(maxsize=4096)
def _dim0_shard(shapes: tuple[tuple[int, ...], ...], degree: int, world: int) -> int:
    return sum(arch.fsdp_shard_elems(s, degree, world) for s in shapes)
