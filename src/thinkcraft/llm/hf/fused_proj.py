"""Sibling projections as one GEMM in the engine's no-grad forwards: each attention's q/k/v, each MLP's gate/up.

Every decoder layer of the Llama / Qwen / Mistral families projects one input three times (q_proj, k_proj, v_proj)
and another twice (gate_proj, up_proj). An engine's decode step at 256 rows is bound by its number of kernels, not
by bytes (H200, 2026-11-29: 1,054 kernels a step, ~2.8 us of gap each, BENCHMARKS §7b); with LoRA on every linear
each projection is three GEMMs (`lora_fast`), 15 for the five. Fused, a group is one GEMM over the concatenated
weights, plus - for LoRA - one over the stacked adapters' A (`[A_q; A_k; A_v] x`) and one `addmm` over their
block-diagonal `(s B)ᵀ`: 6 GEMMs for the five (merged LoRA weights, `THINKCRAFT_LORA_MERGE=1`: 2 for 5).

The adapters' A folded into the base GEMM (`THINKCRAFT_FOLD_LORA_A`, on): a LoRA group's weight copy is
`[W_1; ...; W_k; A_1; ...; A_k]`, so one GEMM gives the base outputs and `x Aᵀ` side by side, and the low-rank part is
added in place by one `addmm_` over the base part's columns (the output is not copied first, as an out-of-place
`torch.addmm(y, h, Bᵀ)` may): 2 kernels a group where there were 3 or more (base, A, addmm). Every other adapted
linear (o_proj, down_proj) becomes a group of one, for the same 2. For the Qwen2.5-0.5B shape with LoRA on every
linear, a decode step at 256 rows went from 686 kernels to 566, 5 a layer (H200, 2026-11-29, BENCHMARKS §7b), but
its time did not follow beyond the runs' spread (the Craftax bench's means 5.25 -> 4.94 ms, the decode probe's
8.30 -> 8.6 ms): the wider GEMMs seem to give back what the launches save. The eager prefill gained 10-14%.
The values are the same products as unfolded (each output column is still one dot product over `x`, rounded once
to the base dtype; the sum with the low-rank part is the GEMM's `beta = 1` epilogue, as `addmm` was); the singles'
weight copies cost 2 bytes a weight of o_proj and down_proj, made only if they fit beside the groups'
(`copies.copies_fit`); `THINKCRAFT_FOLD_LORA_A=0` keeps the unfolded groups and no singles.

How, without touching the model's code: the group's first member (the "leader", q_proj / gate_proj) computes the
whole group's output, returns its own slice and leaves the others' in the group's stash keyed by its input
tensor; a sibling called with that same tensor takes its slice (the last one clears the stash), and one called
with anything else computes its own output as before - so an unusual call order costs the fusion, never the
result. Only in no-grad forwards (the learner's gradient path is untouched), only for members that are plain
half-precision `nn.Linear`s or `lora_fast` layers whose fast forward applies at that call.

The fused tensors are copies (the members' weights stay where they are: the learner, checkpoints and weight
updates see nothing new), `copies.COPY_FREE_FRACTION` of the free memory at most, refreshed like `lora_fast`'s:
an eager forward checks its group's stamps; a compiled or graphed step cannot run Python, so the batcher calls
`refresh` before each step, after `lora_fast.refresh` (whose adapter copies are sources here). The copies are
updated in place, so captured graphs keep reading them. THINKCRAFT_FUSED_PROJ=0 leaves every projection alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf import lora_fast
from thinkcraft.llm.hf.copies import StampedLayers, copies_fit, mixin_class, mixin_getattr, unmix
from thinkcraft.utils.errors import env_switch

_HALF = (torch.bfloat16, torch.float16)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears fused when a module holds all of a tuple's names (leader first). With the adapters' A folded
(`fold_switch`), every other unmerged LoRA linear is a group of one."""


def fold_switch() -> bool:
    """THINKCRAFT_FOLD_LORA_A (on): LoRA groups compute `x Aᵀ` inside the base GEMM, adapted singles are groups."""
    return env_switch("THINKCRAFT_FOLD_LORA_A", default=True)


class Group:
    """One fused group: its members (leader first), the fused copies and the stash of one forward."""

    def __init__(self, members: list[Any], lora: list[bool], merged: bool, fold: bool = False) -> None:
        self.members = members
        self.lora = lora  # per member: a lora_fast layer (its copies are the adapter's sources)
        self.merged = merged  # the LoRA members carry merged weights: no adapter GEMMs
        self.splits = [_base(m).weight.shape[0] for m in members]
        w = _base(members[0]).weight
        n_in, dt, dev = w.shape[1], w.dtype, w.device
        ranks = [m._tc_a.shape[0] if lo and not merged else 0 for m, lo in zip(members, lora)]
        self.ranks = ranks
        self.n_out = sum(self.splits)
        self.fold = fold and sum(ranks) > 0  # A's rows after the base rows in `weight` (the module docstring)
        with torch.inference_mode(False), torch.no_grad():
            rows = self.n_out + (sum(ranks) if self.fold else 0)
            self.weight = torch.empty(rows, n_in, dtype=dt, device=dev)
            has_bias = any(_base(m).bias is not None for m in members)
            self.bias = torch.zeros(rows, dtype=dt, device=dev) if has_bias else None  # A's rows: no bias
            self.a = self.weight[self.n_out:] if self.fold else (
                torch.empty(sum(ranks), n_in, dtype=dt, device=dev) if sum(ranks) else None)
            self.bt = torch.zeros(sum(ranks), self.n_out, dtype=dt, device=dev) if sum(ranks) else None
        self.stash: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.seen: list[Any] = []

    def sources(self) -> list[torch.Tensor]:
        """The tensors the copies come from: each member's weight (its merged copy when merged) and bias, and its
        adapter copies."""
        out: list[torch.Tensor] = []
        for m, lo in zip(self.members, self.lora):
            base = _base(m)
            if lo and self.merged:
                out.append(m._tc_merged)
            else:
                out.append(base.weight)
            if base.bias is not None:
                out.append(base.bias)
            if lo and not self.merged:
                out += [m._tc_a, m._tc_bt]
        return out

    def refresh(self) -> bool:
        """Copy every source into the fused tensors if any changed since the last copy (in place); True if so."""
        stamp = _numbers(self.sources())
        if stamp == self.seen:
            return False
        with torch.no_grad():
            o = r = 0
            for m, lo, n, k in zip(self.members, self.lora, self.splits, self.ranks):
                base = _base(m)
                self.weight[o:o + n].copy_(m._tc_merged if lo and self.merged else base.weight)
                if self.bias is not None and base.bias is not None:
                    self.bias[o:o + n].copy_(base.bias)
                if k:
                    self.a[r:r + k].copy_(m._tc_a)  # type: ignore[index]
                    self.bt[r:r + k, o:o + n].copy_(m._tc_bt)  # type: ignore[index]
                o, r = o + n, r + k
        self.seen = stamp
        return True

    def usable(self, x: torch.Tensor) -> bool:
        """This call may take the fused path: no gradient, the input on the copies' device, every LoRA member's fast
        forward applying now (adapters enabled, one active, ...) in the mode the copies were made for."""
        if torch.is_grad_enabled() or x.device != self.weight.device:
            return False
        for m, lo in zip(self.members, self.lora):
            if lo and (not lora_fast._covered(m) or (m.__dict__.get("_tc_merged") is not None) != self.merged):
                return False
        return True

    def member_forward(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member i's output (None: it computes its own). The leader (i = 0) computes the group and stashes the
        siblings' slices under its input; a sibling takes its slice only for that same input tensor."""
        if i == 0:
            y = self.output(x)
            if y is None or len(self.members) == 1:
                return y  # a group of one: nothing to keep for a sibling
            outs = list(y.split(self.splits, dim=-1))
            self.stash = (x, outs)
            return outs[0]
        st = self.stash
        if st is None or st[0] is not x:
            return None
        out = st[1][i]
        if i == len(self.members) - 1:
            self.stash = None  # the last sibling: nothing of this forward is kept alive
        return out

    def output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole group's output for `x` (its members' side by side), or None where the fused path may not serve
        this call (`usable`); an eager forward first brings the copies up to date. `fused_mlp` reads gate/up whole."""
        if not self.usable(x):
            return None
        if not torch.compiler.is_compiling():  # an eager forward: the adapters' copies, then the group's
            self._refresh_eager()
        return self.compute(x)

    def folded_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """`[base | x Aᵀ]` - the group's GEMM alone, the low-rank part NOT added - for a reader that adds
        `h (sB)ᵀ` itself on its way (`fused_mlp`'s LoRA kernel, `bt` the block-diagonal `(sB)ᵀ`, h the last
        `sum(ranks)` columns); None where A is not folded or where `output` would be None. Like `output`, an eager
        forward first brings the copies up to date (a compiled one's caller refreshes them before the step)."""
        if not self.fold or not self.usable(x):
            return None
        if not torch.compiler.is_compiling():
            self._refresh_eager()
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def _refresh_eager(self) -> None:
        """The adapters' copies, then the group's (an eager forward's first step)."""
        for m, lo in zip(self.members, self.lora):
            if lo:
                lora_fast._refresh_layer(m)
        self.refresh()

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        y = F.linear(x, self.weight, self.bias)
        if self.a is None:
            return y
        compiling = torch.compiler.is_compiling() and env_switch("THINKCRAFT_LORA_ADD_OP", default=True)
        if self.fold:  # y = [base | x Aᵀ]: the low-rank part added into the base columns in place (a strided
            n = self.n_out  # view, which cuBLAS takes as it is: its row stride is the leading dimension)
            y2 = y.reshape(-1, y.shape[-1])
            if compiling:
                _lowrank_add_(y2, self.bt, n, None)
                return y2[:, :n].view(*y.shape[:-1], n)
            out = y2[:, :n]
            out.addmm_(y2[:, n:], self.bt)
            return out.view(*y.shape[:-1], n)
        h = F.linear(x, self.a)
        n = y.shape[-1]
        if compiling:
            y2 = y.reshape(-1, n)
            _lowrank_add_(y2, self.bt, n, h.reshape(-1, h.shape[-1]))
            return y2.view(y.shape)
        return torch.addmm(y.reshape(-1, n), h.reshape(-1, h.shape[-1]), self.bt).view(y.shape)


@torch.library.custom_op("thinkcraft::lowrank_add_", mutates_args=("y",))
def _lowrank_add_(y: torch.Tensor, bt: torch.Tensor, n: int, h: torch.Tensor | None) -> None:
    """`y[:, :n] += h @ bt` in place, h = `y[:, n:]` when None (A folded): one cuBLAS call with `beta = 1`.

    Why an op (compiled forwards only; eager calls `addmm_` directly): traced, `addmm_` on a view of the GEMM's
    output is functionalised into an out-of-place `addmm` whose strided `self` at::addmm copies into a fresh output
    first, then a `slice_scatter` back - at 256 rows on an H200 the decode step's 120 strided bf16 copies, 0.37 of
    its 2.7 ms of kernels (BENCHMARKS §7b, 2026-12-01). Inductor re-inplaces a mutating custom op over a buffer
    nothing else reads (the GEMM's output): no copy, and the same one rounding as the eager `addmm_`.
    THINKCRAFT_LORA_ADD_OP=0: the traced `addmm_` as before (the A/B switch)."""
    if h is None:
        y[:, :n].addmm_(y[:, n:], bt)
    else:
        y.addmm_(h, bt)


def _base(m: Any) -> Any:
    """A member's linear: a LoRA layer's base layer, else the member itself."""
    return getattr(m, "base_layer", m)


def _numbers(tensors: list[torch.Tensor]) -> list[Any]:
    out: list[Any] = []
    for t in tensors:
        out += [t.data_ptr(), t._version]
    return out


class _FusedLinearMixin:
    """Mixed into a plain `nn.Linear` member (the class swapped, as lora_fast's layers are): its no-grad forward
    goes through the group; `lora_fast`'s layers ask the group from their own forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        group = self.__dict__.get("_tc_group")
        if group is not None and not args and not kwargs:
            out = group.member_forward(self._tc_index, x)
            if out is not None:
                return out
        return super().forward(x, *args, **kwargs)  # type: ignore[misc]


def _fusable(m: Any) -> str | None:
    """"lora" (a lora_fast layer), "plain" (a half-precision `nn.Linear`, or one already swapped here) or None."""
    if isinstance(m, lora_fast._FastLoraMixin):
        return "lora" if m.base_layer.weight.dtype in _HALF else None
    if type(m) is torch.nn.Linear or isinstance(m, _FusedLinearMixin):
        return "plain" if m.weight.dtype in _HALF else None
    return None


def _candidates(model: torch.nn.Module, fold: bool) -> list[tuple[list[Any], list[bool], bool]]:
    """(members, lora flags, merged) for every module holding a fusable group of siblings that agree on the input
    size, dtype and device, and on the LoRA mode (all merged or none); with `fold`, then every other unmerged
    lora_fast layer alone."""
    out = []
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            kinds = [_fusable(m) for m in members]
            if any(k is None for k in kinds):
                continue
            ws = [_base(m).weight for m in members]
            if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
                continue
            lora = [k == "lora" for k in kinds]
            modes = {m.__dict__.get("_tc_merged") is not None for m, lo in zip(members, lora) if lo}
            if len(modes) > 1:
                continue
            out.append((members, lora, modes == {True}))
    if fold:
        grouped = {id(m) for members, _, _ in out for m in members}
        out += [([m], [True], False) for m in model.modules()
                if id(m) not in grouped and _fusable(m) == "lora" and m.__dict__.get("_tc_merged") is None]
    return out


def install(model: torch.nn.Module, max_bytes: float | None = None) -> list[Group]:
    """Fuse `model`'s sibling projections (after `lora_fast.install` and any quantisation: members are plain
    half-precision linears or lora_fast layers) and return the groups (empty: nothing changed, also with
    THINKCRAFT_FUSED_PROJ=0 or when the copies do not fit). Idempotent: groups already on their members' device
    are kept."""
    if not env_switch("THINKCRAFT_FUSED_PROJ", default=True):
        return []
    fold = fold_switch()
    found = _candidates(model, fold)
    if not found:
        return []
    kept, todo = [], []
    for members, lora, merged in found:
        g = members[0].__dict__.get("_tc_group")
        same = (g is not None and g.members == members and g.merged == merged and g.fold == (fold and g.a is not None)
                and g.weight.device == _base(members[0]).weight.device)
        (kept if same else todo).append(g if same else (members, lora, merged))
    siblings = [t for t in todo if len(t[0]) > 1]
    singles = [t for t in todo if len(t[0]) == 1]
    if siblings and not copies_fit(_nbytes(siblings), _base(siblings[0][0][0]).weight.device, max_bytes,
                                   "fused q/k/v and gate/up copies (THINKCRAFT_FUSED_PROJ): each projection runs alone"):
        siblings = singles = []  # (the singles are only worth their copies beside the groups)
    if singles and not copies_fit(_nbytes(siblings + singles), _base(singles[0][0][0]).weight.device, max_bytes,
                                  "adapted singles' copies (THINKCRAFT_FOLD_LORA_A): o_proj / down_proj run alone"):
        singles = []
    groups = list(kept)
    for members, lora, merged in siblings + singles:
        g = Group(members, lora, merged, fold)
        for i, m in enumerate(members):
            if not lora[i] and not isinstance(m, _FusedLinearMixin):
                m.__class__ = mixin_class(_FusedLinearMixin, type(m), "FusedProj", globals())
            m._tc_group, m._tc_index = g, i
        g.refresh()
        groups.append(g)
    live = {id(g) for g in groups}
    for m in model.modules():  # a group made before under other settings (the switch, merged weights) lets go
        g = m.__dict__.get("_tc_group")
        if g is not None and id(g) not in live:
            del m.__dict__["_tc_group"]
            m.__dict__.pop("_tc_index", None)
    return StampedGroups(groups)


def _nbytes(todo: list[tuple[list[Any], list[bool], bool]]) -> int:
    """The fused weight copies' bytes (the adapters' rows and biases are small beside them)."""
    need = 0
    for members, _, _ in todo:
        w = _base(members[0]).weight
        need += sum(_base(m).weight.shape[0] for m in members) * w.shape[1] * w.element_size()
    return need


class StampedGroups(StampedLayers):
    """The groups with `copies.StampedLayers`' one-stamp check a step (nothing changed: no group walked)."""

    def __init__(self, groups: list[Group]) -> None:
        super().__init__(groups, lambda g: g.sources(), _numbers, lambda g: g.refresh())


def refresh(groups: list[Group]) -> int:
    """Bring every group's copies up to date (before a compiled or graphed step, after `lora_fast.refresh`); how
    many were copied."""
    if isinstance(groups, StampedLayers):
        return groups.refresh()
    return sum(g.refresh() for g in groups)


def counts(groups: list[Group]) -> dict[str, int]:
    """{"groups": groups (of siblings, and adapted singles), "members": projections they replace, "lora": groups
    with stacked adapters, "folded": of them with A inside the base GEMM, "singles": groups of one}."""
    return {"groups": len(groups), "members": sum(len(g.members) for g in groups),
            "lora": sum(g.a is not None for g in groups), "folded": sum(g.fold for g in groups),
            "singles": sum(len(g.members) == 1 for g in groups)}


def strip(model: torch.nn.Module) -> None:
    """Take the groups out of `model` (a copy for another engine or process, which fuses its own), and the MLPs'
    fused forward that reads them."""
    from thinkcraft.llm.hf import fused_mlp

    fused_mlp.strip(model)
    unmix(model, _FusedLinearMixin, ())
    for m in model.modules():
        m.__dict__.pop("_tc_group", None)
        m.__dict__.pop("_tc_index", None)


# a swapped class unpickled before this process made it
__getattr__ = mixin_getattr(_FusedLinearMixin, "FusedProj", globals())
