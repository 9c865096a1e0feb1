"""Moving stored keys to new positions.

RoPE rotates each pair of key dimensions by ``position * w_i``. When the angle is linear in
the position (plain RoPE and the scalings whose frequency table does not depend on the
position: linear, llama3, YaRN, static NTK), a key computed at ``p`` becomes the key at
``q`` by one more rotation by ``(q - p) * w_i``; nothing else about it changes. Anything
else (mRoPE, long-RoPE's two tables, dual-chunk, position-dependent scaling) cannot be
moved exactly and is refused when blend starts.

The rotation for ``p -> q`` is ``z_q / z_p``, with ``z`` the rows of the very table vLLM
rotates with: the model's dtype (bf16 rounds cos and sin to 8 bits), frequencies, scaling
and YaRN's magnitude factor included. A key stored in bf16 was rounded after its rotation,
so a moved key differs from vLLM's by that rounding (at most 2 units in the last place of
the head's largest element, measured against vLLM's CPU kernel); composing with a float32
table instead adds the table's own bf16 rounding on top (about 1.5 times the mean error).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RopeUnsupported(ValueError):
    """The model's rotary embedding cannot be re-rotated exactly."""


_METHODS = ("forward", "forward_native", "forward_static", "forward_cuda", "forward_cpu",
            "forward_hip", "forward_xpu")


def _check_linear(name: str, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The float32 table must be ``m * (cos, sin)(p * w)`` for one ``w`` and magnitude
    ``m``."""
    n = cos.shape[0]
    mag = torch.sqrt(cos ** 2 + sin ** 2)
    m = float(mag[0].mean())
    if n < 2 or not torch.allclose(mag, torch.full_like(mag, m), rtol=1e-4, atol=0):
        raise RopeUnsupported(f"rotary embedding {name}: its table's magnitude varies "
                              "with the position")
    w = torch.atan2(sin[1], cos[1])
    pos = torch.arange(0, n, max(1, n // 257), dtype=torch.float64)
    pos = torch.cat([pos, torch.tensor([n - 1.0])])
    angle = pos[:, None] * w[None, :]
    err = ((cos[pos.long()] - m * torch.cos(angle)).abs().max()
           + (sin[pos.long()] - m * torch.sin(angle)).abs().max())
    # Float32 angles drift by about position * 6e-8 rad; non-linear tables are off by far
    # more than this bound.
    if float(err) > 1e-2 * m + n * 1e-7:
        raise RopeUnsupported(
            f"rotary embedding {name}: its angles are not proportional to the position "
            f"(off by {float(err):.3g}), so a stored key cannot be moved by one rotation")


class ReRotator:
    def __init__(self, rope: torch.nn.Module) -> None:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        name = type(rope).__name__
        if not isinstance(rope, RotaryEmbedding) or any(
                getattr(type(rope), m, None) is not getattr(RotaryEmbedding, m, None)
                for m in _METHODS):
            raise RopeUnsupported(
                f"rotary embedding {name} does not rotate by a plain table lookup at each "
                "position, so stored keys cannot be moved to new positions exactly")
        self.rotary_dim: int = rope.rotary_dim
        self.head_size: int = rope.head_size
        self.neox: bool = rope.is_neox_style
        half = self.rotary_dim // 2
        exact = rope._compute_cos_sin_cache().to(torch.float64)  # [max_pos, rotary_dim]
        self.max_position = exact.shape[0]
        _check_linear(name, exact[:, :half], exact[:, half:])
        used = getattr(rope, "cos_sin_cache", None)  # as vLLM holds it: the model's dtype
        if used is None or used.shape != exact.shape:
            raise RopeUnsupported(f"rotary embedding {name}: it holds no cos/sin cache of "
                                  f"shape {tuple(exact.shape)} to rotate with")
        used = used.to("cpu", torch.float64)
        self.cos, self.sin = used[:, :half], used[:, half:]

    def delta(self, from_pos: torch.Tensor, to_pos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, rotary_dim / 2]`` of the rotations that move keys from
        positions ``from_pos[i]`` to ``to_pos[i]``: ``z_q * conj(z_p) / |z_p|^2`` per token,
        not one angle for all, because the table's rows are rounded per position and undoing
        exactly the row vLLM used is what makes the moved key vLLM's at the new position."""
        for p in (from_pos, to_pos):
            if p.numel() and not (0 <= int(p.min()) and int(p.max()) < self.max_position):
                raise ValueError(f"positions {int(p.min())}..{int(p.max())} are outside the "
                                 f"rotary table (0..{self.max_position - 1})")
        cp, sp = self.cos[from_pos], self.sin[from_pos]
        cq, sq = self.cos[to_pos], self.sin[to_pos]
        m2 = cp * cp + sp * sp
        return (cq * cp + sq * sp) / m2, (sq * cp - cq * sp) / m2

    def mover(self, from_pos: torch.Tensor, to_pos: torch.Tensor, device: torch.device
              ) -> KeyMover:
        """Moves keys ``[n, heads, head_size]`` computed at ``from_pos[i]`` to ``to_pos[i]``
        (CPU position tensors); the rotations are computed once, for every layer's keys."""
        if torch.equal(from_pos, to_pos):
            return _unmoved
        cos, sin = self.delta(from_pos, to_pos)
        return _Rotation(cos.to(device, torch.float32)[:, None, :],
                         sin.to(device, torch.float32)[:, None, :], self.rotary_dim, self.neox)

    def move(self, key: torch.Tensor, from_pos: int, to_pos: int) -> torch.Tensor:
        """Keys ``[tokens, heads, head_size]`` computed at ``from_pos + i``, moved to
        ``to_pos + i``."""
        n = key.shape[0]
        return self.mover(torch.arange(from_pos, from_pos + n),
                          torch.arange(to_pos, to_pos + n), key.device)(key)


#: ``move(keys [n, heads, head_size]) -> keys`` at their new positions.
KeyMover = Callable[[torch.Tensor], torch.Tensor]


def _unmoved(key: torch.Tensor) -> torch.Tensor:
    return key


class _Rotation:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                 neox: bool) -> None:
        self.cos, self.sin, self.r, self.neox = cos, sin, rotary_dim, neox

    def __call__(self, key: torch.Tensor) -> torch.Tensor:
        r, cos, sin = self.r, self.cos, self.sin
        k = key.to(torch.float32)
        rot = k[..., :r]
        if self.neox:
            x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out, k[..., r:]], dim=-1).to(key.dtype)
