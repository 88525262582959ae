"""The parallel layout: world = DP × TP ranks, expert parallelism on or off, sequence parallelism.

`rank = dp_rank * tp + tp_rank`. With EP on, the EP group is the whole world and rank r owns the
contiguous experts `[r·L, (r+1)·L)`, `L = E / world`. With EP off, every expert is sharded along its
intermediate dimension over TP (and replicated over DP).
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout that cannot work; raised before any process starts."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    ep: bool = False
    sp: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def ep_size(self) -> int:
        return self.world_size if self.ep else 1

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        """The global rank of TP rank `tp_rank` in DP group `dp_rank`."""
        return dp_rank * self.tp + tp_rank

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        return [self.rank(dp_rank, t) for t in range(self.tp)]

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        return [self.rank(d, tp_rank) for d in range(self.dp)]

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def label(self) -> str:
        """`TPxDP`, then `-ep` / `-sp` when on: the name commands and reports use."""
        return f"{self.tp}x{self.dp}" + ("-ep" if self.ep else "") + ("-sp" if self.sp else "")

    def validate(
        self,
        *,
        num_experts: int | None = None,
        intermediate: int | None = None,
        shared_intermediate: int | None = None,
        world_size: int | None = None,
    ) -> "Layout":
        """Refuse, with one sentence naming the cause, a layout these sizes cannot run on."""
        if self.tp < 1 or self.dp < 1:
            raise LayoutError(f"TP and DP must be at least 1, got TP={self.tp}, DP={self.dp}.")
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(
                f"world size {world_size} does not equal DP × TP = {self.dp} × {self.tp} = {self.world_size}."
            )
        if num_experts is not None and self.ep and num_experts % self.ep_size:
            raise LayoutError(f"{num_experts} experts cannot be split evenly over an EP group of {self.ep_size} ranks.")
        if intermediate is not None and not self.ep and intermediate % self.tp:
            raise LayoutError(f"TP={self.tp} does not divide the expert intermediate size {intermediate} (EP is off).")
        if shared_intermediate and shared_intermediate % self.tp:
            raise LayoutError(f"TP={self.tp} does not divide the shared-expert intermediate size {shared_intermediate}.")
        return self

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Read `TPxDP[-ep][-sp]`, e.g. `2x2-ep`, `1x2-ep-sp`."""
        head, *flags = text.strip().split("-")
        try:
            tp, dp = (int(part) for part in head.lower().split("x"))
        except ValueError:
            raise LayoutError(f"layout {text!r} is not of the form TPxDP[-ep][-sp], e.g. 2x2-ep.") from None
        unknown = set(flags) - {"ep", "sp"}
        if unknown:
            raise LayoutError(f"layout {text!r} has unknown flag(s) {sorted(unknown)}; known: ep, sp.")
        return cls(tp=tp, dp=dp, ep="ep" in flags, sp="sp" in flags)
