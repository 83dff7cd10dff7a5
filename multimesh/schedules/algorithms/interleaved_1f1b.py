"""Interleaved 1F1B (Megatron): 1F1B over V stages per submesh, in microbatch groups of P."""

from __future__ import annotations

from ..registry import register_schedule
from .one_f_one_b import OneFOneBFamily


@register_schedule
class Interleaved1F1B(OneFOneBFamily):
    """Megatron's interleaved 1F1B, named explicitly: 1F1B over several stages per
    submesh, in microbatch groups of P."""

    name = "interleaved-1f1b"
    interleave = 2
    without_interleaving = ("1F1B", "1f1b")
