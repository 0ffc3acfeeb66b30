"""Quantized weights: the layouts engines serve (FP8 blocks, channels, tensors; e8m0 scales) and the
quantizer that writes them, bit-identical to the reference each formula names.

- :mod:`tensorxfer.quant.layout` -- :class:`Quantization` (block shape, formula, scale encoding), the
  block :class:`Grid` of a tensor, and the derived names a sync plans a quantized tensor's values and
  scales under.  Pure.
- :mod:`tensorxfer.quant.quantize` -- block amaxes and FP8 values and scales of a shard (torch, CPU or GPU).
"""

from tensorxfer.quant.layout import FP8_MAX, Grid, Quantization, derived_name, parse_derived

__all__ = ["FP8_MAX", "Grid", "Quantization", "derived_name", "parse_derived"]
