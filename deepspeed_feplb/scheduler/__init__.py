"""The process boundary: ranks publish counts, a planner (a process, or the ranks themselves)
answers with a `Plan`.

* `mailbox`: the shared-memory layout both sides read and write (counts in, plans out);
* `process`: the `feplb-sched` process (numpy + the compiled planner, no torch);
* `client`: the ranks' side, `InlineScheduler` and `ProcessScheduler`.

What crosses the boundary per micro-batch: each rank's counts ``int64 [E_local]``, the
`PlanConstraints` (with the time model) and the rank's row of the layer's residency masks in;
the `Plan` (moves ``int64 [M, 4]``, rank_rows ``int64 [G]``) and the planning time out. To add a
scheduler (another process model, a remote planner), implement `Scheduler` and select it in
`make_scheduler`.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from deepspeed_feplb.config import SchedulerConfig
from deepspeed_feplb.plan.policy import PlanConstraints
from deepspeed_feplb.scheduler.client import DomainPlan, InlineScheduler, ProcessScheduler
from deepspeed_feplb.segments import PeerWatch


class Scheduler(Protocol):
    """One rank's handle on its domain's planner."""

    def publish(self, seq: int, counts: np.ndarray, constraints: PlanConstraints,
                resident: np.ndarray | None = None, dynamic: np.ndarray | None = None) -> None:
        """This rank's counts ``int64 [E_local]`` for micro-batch ``seq`` (balanced micro-batches
        count up from 0), its row of the residency masks (int64 [E_local, W], `plan.residency`;
        None: none) and the dynamic experts it chose (int64 [<= 2D]; None: its D hottest)."""

    def plan(self, seq: int) -> DomainPlan:
        """The domain's plan for ``seq``: the same on every rank; never hangs past the configured timeouts."""

    def plan_ready(self, seq: int) -> bool:
        """Whether `plan` for ``seq`` would return without waiting (for a peer or the planner): the
        caller polls it between its static experts and sends phase 2's chunks as soon as it can."""

    def scheduler_pid(self) -> int:
        """Pid of the scheduler process serving the domain, 0 when none."""

    def revive(self) -> None:
        """Restart a dead scheduler process now, where this rank owns it (a no-op otherwise)."""

    def close(self) -> None:
        """Stop what this rank started and unmap the mailbox (the creator also unlinks it)."""


def make_scheduler(config: SchedulerConfig, name: str, local_rank: int, ranks: int, create: bool,
                   watch: PeerWatch | None = None, moves_at_once: bool = False) -> Scheduler:
    """The scheduler for ``feplb.scheduler`` (``mode``: ``process`` or ``inline``). The domain's
    rank 0 calls this with ``create=True`` before the others (the caller's barrier).
    ``moves_at_once``: the first plans wait for the planner to load (``feplb.fixed_costs:
    "ignore"``, ``max_rows_over_mean``) instead of moving nothing until it is loaded."""
    if config.mode == "inline":
        return InlineScheduler(name, local_rank, ranks, peer_timeout_s=config.peer_timeout_s, create=create,
                               watch=watch)
    return ProcessScheduler(name, local_rank, ranks, plan_timeout_s=config.plan_timeout_ms / 1e3,
                            peer_timeout_s=config.peer_timeout_s, restart=config.restart, create=create,
                            start_after_steps=config.start_after_steps, watch=watch, moves_at_once=moves_at_once)


__all__ = ["DomainPlan", "InlineScheduler", "ProcessScheduler", "Scheduler", "make_scheduler"]
