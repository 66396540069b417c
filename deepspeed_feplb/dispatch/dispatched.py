"""What a dispatcher returns: the rows, their counts, its handle, and the facts the EP group shares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class GroupFacts:
    """What phase 1's count exchange told every rank of the EP group alike (None: a backend that
    exchanges only each rank's own receive counts, as DeepEP's layout does).

    received: int64 ``[ep_size, E_local]``, rows each rank of the group received per local expert;
    announced: float64 ``[ep_size, A]``, each rank's ``announce`` values;
    exchange_seconds: host time this rank spent in the exchange (NaN: none).
    """
    received: Optional[np.ndarray] = None
    announced: Optional[np.ndarray] = None
    exchange_seconds: float = float("nan")


class Dispatched(NamedTuple):
    """`Dispatcher.dispatch`'s result: rows ``[N, H]`` grouped by local expert, then by source rank;
    counts int64 ``[ep_size, E_local]`` (numpy), rows from each source rank per local expert; the
    handle `combine` needs; the `GroupFacts`."""
    rows: torch.Tensor
    counts: np.ndarray
    handle: Any
    facts: GroupFacts
