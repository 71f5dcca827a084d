"""The recurrent mixers of hybrid models (Mamba1, Mamba2, gated DeltaNet): their dimensions
and the shapes of the states one layer keeps per request.

State shapes per layer and request (DESIGN.md 7), per tensor-parallel rank.  The conv state is
always ``(d_conv - 1, channels)``: the kernel's past inputs first, then the channels (``d_conv``
is the conv kernel size: ``conv_kernel``, ``mamba_d_conv``, ``linear_conv_kernel_dim``):

=========  ==================================================  ==========================
mixer      conv state ``(d_conv - 1, channels)``               SSM state
=========  ==================================================  ==========================
Mamba1     ``(d_conv - 1, d_inner / tp)``                      ``(d_inner / tp, d_state)``
Mamba2     ``(d_conv - 1, (d_inner + 2 g d_state) / tp)``      ``(heads / tp, head_dim,
           with ``g`` B/C groups; when ``g % tp != 0`` the      d_state)``
           groups are replicated: 1 group per rank
GDN        ``(d_conv - 1, (2 nk dk + nv dv) / tp)``            ``(nv / tp, dk, dv)``
=========  ==================================================  ==========================

(The states' dtypes come from the model config: ``HybridModel.state_dtypes``.)
"""

from __future__ import annotations

from dataclasses import dataclass

from mambakv.core.errors import ModelConfigError

__all__ = ["GatedDeltaNetDims", "Mamba1Dims", "Mamba2Dims", "MixerDims", "split_per_rank"]


def split_per_rank(value: int, tp: int, what: str) -> int:
    """`value` (heads, channels) divided over `tp` tensor-parallel ranks; ModelConfigError
    naming `what` when it does not divide."""
    if tp <= 0 or value % tp:
        raise ModelConfigError(f"{what} = {value} is not divisible by tp_size {tp}")
    return value // tp


@dataclass(frozen=True)
class Mamba1Dims:
    """Mamba1 mixer: ``d_inner`` channels, ``d_state`` per channel, conv kernel ``d_conv``."""

    d_inner: int
    d_state: int
    d_conv: int
    kind = "mamba1"

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = split_per_rank(self.d_inner, tp, "d_inner")
        return (self.d_conv - 1, d), (d, self.d_state)


@dataclass(frozen=True)
class Mamba2Dims:
    """Mamba2 mixer: ``n_heads x head_dim`` channels, ``n_groups`` B/C groups of ``d_state``."""

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    kind = "mamba2"

    def groups_per_rank(self, tp: int) -> int:
        if self.n_groups % tp == 0:
            return self.n_groups // tp
        if tp % self.n_groups == 0:  # replicated: each rank keeps the one group its heads use
            return 1
        raise ModelConfigError(f"n_groups {self.n_groups} and tp_size {tp} do not divide")

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        heads = split_per_rank(self.n_heads, tp, "Mamba2 heads")
        conv_dim = heads * self.head_dim + 2 * self.groups_per_rank(tp) * self.d_state
        return (self.d_conv - 1, conv_dim), (heads, self.head_dim, self.d_state)


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """Gated DeltaNet (Qwen3-Next linear attention): ``nk`` key heads of ``dk``, ``nv`` value
    heads of ``dv``, conv kernel ``conv_kernel``."""

    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int
    kind = "gdn"

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        nk = split_per_rank(self.n_k_heads, tp, "GDN key heads")
        nv = split_per_rank(self.n_v_heads, tp, "GDN value heads")
        return (self.conv_kernel - 1, 2 * nk * self.d_k + nv * self.d_v), (nv, self.d_k, self.d_v)


MixerDims = Mamba1Dims | Mamba2Dims | GatedDeltaNetDims
