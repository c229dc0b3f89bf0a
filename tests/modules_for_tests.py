"""Modules and factories built to break one check each (the README examples live in fixtures/modules)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attn_ledger.inputs.userload import load_object

FIXTURE_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "modules" / "attention_modules.py"
SdpaAttention = load_object(f"{FIXTURE_FILE}:SdpaAttention")


class Scaled(SdpaAttention):
    """Healthy, but its output is tiny (out_proj scaled by 1e-6): thresholds must follow the output's scale."""

    def __init__(self, embed_dim: int, num_heads: int, factor: float = 1e-6, causal: bool = True) -> None:
        super().__init__(embed_dim, num_heads, causal=causal)
        self.factor = factor
        with torch.no_grad():
            self.out_proj.weight.mul_(factor)
            self.out_proj.bias.mul_(factor)


class TinyLeak(Scaled):
    """Tiny outputs and a leak: position 0 reads the mean of the future, scaled like everything else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).clone()
        y[:, 0] = y[:, 0] + 0.5 * self.factor * x[:, 1:].mean(dim=1)
        return y


class Zeros(nn.Module):
    """Returns zeros: the intervention changes nothing on either side (vacuous)."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class TupleOut(SdpaAttention):
    """Healthy, returning ``(output, None)`` like MHA does."""

    def forward(self, x: torch.Tensor):
        return super().forward(x), None


class Stateful(SdpaAttention):
    """Carries state between calls: each call adds a running count."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__(embed_dim, num_heads)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) + 1e-3 * self.calls


class RaisesAtT1(SdpaAttention):
    """Squeezes the position axis, so T = 1 breaks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).squeeze(1)
        if y.dim() != 3:
            raise RuntimeError(f"expected a 3-D tensor, got {y.dim()}-D")
        return y


class WrongShape(SdpaAttention):
    """Returns ``[B, E, T]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).transpose(1, 2)


class AlwaysRaises(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.lin = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("forward is broken")


class DetachedValue(SdpaAttention):
    """v_proj's output is detached, so v_proj never receives a gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nh = self.num_heads
        b, t, e = x.shape

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, nh, e // nh).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x).detach())
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(ctx.transpose(1, 2).reshape(b, t, e))


class NonFinite(SdpaAttention):
    """Overflows to inf at the last position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).clone()
        y[:, -1] = y[:, -1] * float("inf")
        return y


class WithNorm(SdpaAttention):
    """Healthy but with a LayerNorm outside the projections: the rebuild cannot model it."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__(embed_dim, num_heads)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


class Positional(SdpaAttention):
    """Non-causal with a learned position embedding: order matters legitimately."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__(embed_dim, num_heads, causal=False)
        self.pos_embedding = nn.Parameter(torch.randn(64, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.pos_embedding[: x.shape[1]])


def scaled(e: int, n: int) -> nn.Module:
    return Scaled(e, n)


def tiny_leak(e: int, n: int) -> nn.Module:
    return TinyLeak(e, n)


def zeros(e: int, n: int) -> nn.Module:
    return Zeros(e, n)


def tuple_out(e: int, n: int) -> nn.Module:
    return TupleOut(e, n)


def stateful(e: int, n: int) -> nn.Module:
    return Stateful(e, n)


def raises_at_t1(e: int, n: int) -> nn.Module:
    return RaisesAtT1(e, n)


def wrong_shape(e: int, n: int) -> nn.Module:
    return WrongShape(e, n)


def always_raises(e: int, n: int) -> nn.Module:
    return AlwaysRaises(e, n)


def detached_value(e: int, n: int) -> nn.Module:
    return DetachedValue(e, n)


def non_finite(e: int, n: int) -> nn.Module:
    return NonFinite(e, n)


def with_norm(e: int, n: int) -> nn.Module:
    return WithNorm(e, n)


def positional(e: int, n: int) -> nn.Module:
    return Positional(e, n)


def factory_raises(e: int, n: int) -> nn.Module:
    raise ValueError(f"embed_dim={e} not divisible by num_heads={n}")


def not_a_module(e: int, n: int) -> object:
    return "attention"


class InputDetached(SdpaAttention):
    """Detaches its input, so no gradient reaches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.detach())


def input_detached(e: int, n: int) -> nn.Module:
    return InputDetached(e, n)


class NonFiniteGradient(SdpaAttention):
    """Healthy output, but its gate parameter's gradient is NaN (sqrt at 0, times 0)."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__(embed_dim, num_heads)
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * self.gate.sqrt()


def non_finite_gradient(e: int, n: int) -> nn.Module:
    return NonFiniteGradient(e, n)
