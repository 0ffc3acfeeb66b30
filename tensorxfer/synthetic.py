"""Synthetic models shaped like the reference run (820 tensors, 31.2 GB).

Used by the demo, the benchmarks and ``tensorxfer-bench``.  The size spread
is that of a decoder-only transformer: per layer four attention matrices,
three MLP matrices and two norm vectors, plus one embedding and one output
matrix at the ends.  With 91 layers that is 91 * 9 + 2 = 821 tensors — we
drop the final norm to get exactly 820.  Big matrices hold ~99.9% of the
bytes; the norms are the "many small tensors".  ``scale_to`` picks the
hidden size so the total lands near the requested byte count.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tensorxfer.dtypes import DTYPES

REFERENCE_TENSORS = 820
REFERENCE_BYTES = 31_200_000_000
LAYERS = 91


def layout(total_bytes: int = REFERENCE_BYTES, dtype: str = "BF16") -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` for 820 tensors totalling about ``total_bytes``."""
    item = DTYPES[dtype].itemsize
    vocab_ratio = 8       # vocab = 8 * hidden; MLP intermediate = 4 * hidden; hidden a multiple of 16

    def total(h: int) -> int:
        inter = 4 * h
        per_layer = 4 * h * h + 3 * h * inter + 2 * h
        return (LAYERS * per_layer + 2 * vocab_ratio * h * h) * item

    h = 16
    while total(h + 16) <= total_bytes:
        h += 16
    inter, vocab = 4 * h, vocab_ratio * h
    out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", dtype, (vocab, h))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", dtype, (h,)),
            (p + "self_attn.q_proj.weight", dtype, (h, h)),
            (p + "self_attn.k_proj.weight", dtype, (h, h)),
            (p + "self_attn.v_proj.weight", dtype, (h, h)),
            (p + "self_attn.o_proj.weight", dtype, (h, h)),
            (p + "post_attention_layernorm.weight", dtype, (h,)),
            (p + "mlp.gate_proj.weight", dtype, (inter, h)),
            (p + "mlp.up_proj.weight", dtype, (inter, h)),
            (p + "mlp.down_proj.weight", dtype, (h, inter)),
        ]
    out.append(("lm_head.weight", dtype, (vocab, h)))
    return out[:REFERENCE_TENSORS]


def tensors(total_bytes: int, dtype: str = "BF16", seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Random host tensors for :func:`layout` (random bits, never zeros)."""
    rng = np.random.default_rng(seed)
    npdt = DTYPES[dtype].numpy
    for name, _, shape in layout(total_bytes, dtype):
        n = int(np.prod(shape)) * npdt.itemsize
        yield name, rng.integers(0, 256, size=n, dtype=np.uint8).view(npdt).reshape(shape)
