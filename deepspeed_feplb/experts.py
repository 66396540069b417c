"""Expert calling: how a layer's experts are computed, on whatever parameters a forward binds.

* `ExpertSpec`: any local expert run functionally (its module as a template, parameters and
  buffers bound for the call: `bound`, `tensor_slots`), or several at once by a grouped call;
  helpers compute the chunks they serve with it (`migrate.phase2`).
* `LocalExperts`: how a layer kind computes its ``E_local`` experts at home: the modules
  themselves (`LocalExperts.calls`), functionally (`functional_calls`), or a set at once
  (``static_fn``: AutoEP's grouped GEMM, `grouped_mlp.StackedMLP`).
* `on_graph`: outputs of experts without rows, kept on the backward's graph.
* `timed_pieces`: a set of experts computed in order, timed for the cost fit, with a point
  between calls where other work (phase 2's sends) may run.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import torch

# grouped(weights, x, sizes) -> y: k experts at once, ``weights[j]`` the k experts' parameter j stacked
# ``[k, *shape_j]``, ``x`` ``[N, H]`` their rows in order (``sizes[i]`` rows of expert i) -> ``[N, H_out]``
GroupedCall = Callable[[list, torch.Tensor, list], torch.Tensor]


def tensor_slots(module: torch.nn.Module, buffers: bool = False) -> list[tuple[dict, str, int]]:
    """Where ``module`` keeps its parameters (and, with ``buffers``, then its buffers): per tensor
    under each of its names, (owning submodule's ``_parameters`` or ``_buffers``, name there, index
    in ``named_parameters()`` order, buffers numbered on after the parameters)."""
    subs, slots, index = list(module.modules()), [], {}
    for kind in ("_parameters", "_buffers") if buffers else ("_parameters", ):
        seen: dict = {}
        for sub in subs:
            table = getattr(sub, kind)
            for key, t in table.items():
                if t is not None:
                    slots.append((table, key, len(index) + seen.setdefault(id(t), len(seen))))
        index.update(seen)
    return slots


@contextmanager
def bound(slots: list[list[tuple[dict, str, int]]], tensors: list[list[torch.Tensor]]):
    """Module i holds ``tensors[i]`` as its parameters (and buffers) inside the block (``slots[i]``:
    its `tensor_slots`), as `torch.func.functional_call` binds them around one call: calling the
    module computes on them, with the same graph. Its own come back when the block ends, however
    it ends."""
    saved = []
    try:
        for module_slots, values in zip(slots, tensors):
            for table, key, i in module_slots:
                saved.append((table, key, table[key]))
                table[key] = values[i]
        yield
    finally:
        for table, key, tensor in reversed(saved):
            table[key] = tensor


@dataclass
class ExpertSpec:
    """How to run any local expert functionally: its module and parameter/buffer names; ``grouped``:
    how to run several at once (a grouped GEMM, for experts without buffers), or None: one call each."""
    param_names: list[str]
    buffer_names: list[str]
    grouped: Optional[GroupedCall] = None

    @classmethod
    def of(cls, expert: torch.nn.Module, grouped: Optional[GroupedCall] = None) -> "ExpertSpec":
        buffer_names = [n for n, _ in expert.named_buffers()]
        if grouped is not None and buffer_names:
            raise ValueError(f"a grouped expert call takes stacked parameters only; this expert has buffers "
                             f"{buffer_names}")
        return cls([n for n, _ in expert.named_parameters()], buffer_names, grouped)

    @staticmethod
    def buffers(module: torch.nn.Module) -> list[torch.Tensor]:
        return [b for _, b in module.named_buffers()]

    def call(self, module, params, buffers, x):
        """``module`` on rows x ``[n, H]`` with ``params`` (``param_names`` order) and ``buffers``
        bound as its own (`bound`: `functional_call`'s binding without its cost per call)."""
        with bound([tensor_slots(module, buffers=bool(self.buffer_names))], [[*params, *buffers]]):
            return run_expert(module, x)


def run_expert(expert: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``expert`` on rows x ``[n, H]``: its output, the first element where it returns a tuple."""
    out = expert(x)
    return out[0] if isinstance(out, tuple) else out


def on_graph(x: torch.Tensor, params: Sequence[torch.Tensor], always: bool = False) -> torch.Tensor:
    """``x`` (e.g. ``[0, H]``, the outputs of experts given no rows) on the autograd graph of
    ``params`` while gradients flow and ``x`` needs none. An all-to-all has a backward on a rank
    only if its input needs a gradient; where the layer's input needs none (the layers before it
    frozen), a rank whose experts got no rows would otherwise skip the backward all-to-all its peers
    wait in (they hung). The link adds zero to ``x`` and to one parameter's gradient, as computing
    the experts on no rows does. ``always``: link where ``x`` needs a gradient too (experts given no
    rows, and no other call of this micro-batch that takes their parameters: the link is then what
    gives them their zero gradients)."""
    trained = [p for p in params if p.requires_grad]
    if torch.is_grad_enabled() and (always or not x.requires_grad) and trained:
        return x + trained[0].reshape(-1)[:0].sum()
    return x


# static_fn(rows, blocks, static) -> outputs of the experts in ``static`` (local ids, ascending),
# concatenated in expert order; ``rows`` ``[N, H]`` the micro-batch's rows grouped by expert,
# ``blocks[e]`` ``[n_e, H]`` expert e's (one split of ``rows``: its backward is one concatenation,
# where a slice per expert would zero-fill a full-size gradient each). A layer kind's
# `LocalExperts.static_fn` takes this forward's parameters first (`LocalExperts.static`).
StaticFn = Callable[[torch.Tensor, list, list], torch.Tensor]
ExpertCall = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class LocalExperts:
    """How a layer kind computes its ``E_local`` experts.

    modules: one module per local expert, run functionally as a template (`ExpertSpec.call`);
    params: per local expert, its parameters in ``spec.param_names`` order (they may be aliases
        that route gradients, `deepspeed_moe.ExpertGradOrder`);
    direct: ``call(e, x)`` as the model itself runs expert e (``modules[e]``, each its own), for
        experts computed at home: with `calls`, on ``params`` bound as the modules' parameters
        (None: functionally);
    static_fn: ``static_fn(params, rows, blocks, static)`` computes a set of experts at once on
        ``params`` (AutoEP's grouped GEMM, a known MLP's `grouped_mlp.StackedMLP`), or None.
    current: outside a forward, each local expert's parameters as they are now (`migrate.refresh`,
        after an optimizer step); None: ``params`` called without gradients.
    """
    modules: Sequence[torch.nn.Module]
    params: Callable[[], list[list[torch.Tensor]]]
    spec: ExpertSpec
    direct: Optional[ExpertCall] = None
    static_fn: Optional[Callable[..., torch.Tensor]] = None
    current: Optional[Callable[[], list[list[torch.Tensor]]]] = None

    def weights_now(self) -> list[list[torch.Tensor]]:
        """`current`, or ``params`` without gradients: no graph, the parameters' own values."""
        if self.current is not None:
            return self.current()
        with torch.no_grad():
            return self.params()

    def __post_init__(self):
        if self.direct is not None and len({id(m) for m in self.modules}) != len(self.modules):
            raise ValueError("direct calls need one module per local expert; shared templates run functionally")

    def static(self, params: Optional[list[list[torch.Tensor]]]) -> Optional[StaticFn]:
        """`static_fn` on ``params`` (None: the modules' own parameters, for direct calls)."""
        if self.static_fn is None:
            return None
        if params is None:
            params = [list(m.parameters()) for m in self.modules]
        return partial(self.static_fn, params)

    @contextmanager
    def calls(self, params: list[list[torch.Tensor]]):
        """``call(e, x)``: expert e on rows x ``[n, H]`` with ``params[e]``. With `direct`, the modules
        themselves, ``params`` bound as their parameters until the block ends (`phase2.bound`: once
        per forward for all experts, where functional calls bind around each); else functionally."""
        if self.direct is None:
            yield functional_calls(self.modules, params, self.spec)
            return
        # where each module keeps its parameters, looked up now: a submodule replaced since is bound too
        with bound([tensor_slots(m) for m in self.modules], params):
            yield self.direct


def functional_calls(modules: Sequence[torch.nn.Module], params: list[list[torch.Tensor]],
                     spec: ExpertSpec) -> ExpertCall:
    """``call(e, x)``: local expert e on rows x, run functionally with ``params[e]`` and its own buffers."""
    return lambda e, x: spec.call(modules[e], params[e], spec.buffers(modules[e]), x)


def timed_pieces(rows: torch.Tensor, blocks: list, experts: Sequence[int], mark: Callable[[], object],
                 call: ExpertCall, static_fn: Optional[StaticFn] = None, pieces: Optional[list] = None,
                 between: Optional[Callable[[], Optional[Callable[[], None]]]] = None) -> list[torch.Tensor]:
    """Outputs of ``experts`` (local ids, ascending) on their rows (``blocks[e]`` ``[n_e, H]``, a
    split of ``rows``): ``call(e, x)`` each, or ``static_fn`` for all at once. Appends samples
    (k pieces with rows, n rows, start mark, end mark) of the calls to ``pieces``: one for them all
    (the fit ``t = k * piece + n * row`` holds for a sum of calls as for one, and one pair of marks
    per stage, CUDA events on a GPU, costs the host less than a pair per expert), split where
    ``between()``, asked after each call (after the grouped one), returns work to do there (phase
    2's sends, once the plan is in hand): that work is not expert compute."""
    sizes = [len(blocks[e]) for e in experts]
    timed = pieces is not None and sum(sizes) > 0
    k = n = 0
    start = mark() if timed else None

    def called(pieces_with_rows: int, rows_: int) -> None:
        nonlocal k, n, start
        k, n = k + pieces_with_rows, n + rows_
        work = between() if between is not None else None
        if work is None:
            return
        if timed and n:
            pieces.append((k, n, start, mark()))
        work()
        k = n = 0
        if timed:
            start = mark()

    if static_fn is not None:
        outs = list(static_fn(rows, blocks, list(experts)).split(sizes))
        called(sum(size > 0 for size in sizes), sum(sizes))
    else:
        outs = []
        for e, size in zip(experts, sizes):
            outs.append(call(e, blocks[e]))
            called(int(size > 0), size)
    if timed and n:
        pieces.append((k, n, start, mark()))
    return outs
