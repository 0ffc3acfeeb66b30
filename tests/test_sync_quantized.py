"""FP8 targets fed by a weight sync: sources quantize on the way, targets land FP8 values and scales.

Ranks run as threads of this process, each with its own TCPStore client (as test_sync does); the
byte-for-byte reference is the same quantizer over the whole global tensor (itself checked against
transformers and DeepGEMM in test_quant).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the weight sync's tensors are torch tensors")

import tensorxfer as tx  # noqa: E402
from tensorxfer.quant.quantize import block_amax, quantize_into  # noqa: E402
from tensorxfer.sync import Box, Piece, Quantization, Source, Target, chunk_box  # noqa: E402
from tests.test_sync import Stores, _catch, run_ranks  # noqa: E402


def reference(w: torch.Tensor, q: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    grid = q.grid(tuple(w.shape))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid.scale_shape, dtype=torch.float8_e8m0fnu if q.scale == "e8m0" else torch.float32)
    quantize_into(w, grid, (0,) * w.dim(), q, block_amax(w, grid, (0,) * w.dim()), values, scales)
    return values, scales


def scale_tensor(q: Quantization, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float8_e8m0fnu if q.scale == "e8m0" else torch.float32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def weights(step: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {n: (torch.randn(s, generator=g) * 0.02 * (1 + step)).to(dtype) for n, s in shapes.items()}


def row_shards(w: dict[str, torch.Tensor], rank: int, count: int) -> dict[str, Source]:
    """FSDP2's Shard(0): torch.chunk rows, uneven (blocks straddle the cuts)."""
    out = {}
    for name, t in w.items():
        box = chunk_box(tuple(t.shape), 0, rank, count)
        out[name] = Source(t[box.offsets[0]:box.offsets[0] + box.sizes[0]].clone(), tuple(t.shape), box, adopt=False)
    return out


def group(sources: list[dict[str, Any]], targets: list[dict[str, Target]], transport: str = "tcp",
          **kw: Any) -> list[Any]:
    """The group's ranks: its sources, then its targets (the last item: the store server, kept alive)."""
    stores = Stores()
    n, m = len(sources), len(targets)
    return [*run_ranks(
        [lambda r=r: tx.WeightSync(stores.client(), "q", "source", r, (n, m), sources[r], token="k",
                                   transport=transport, timeout=30, **kw) for r in range(n)] +
        [lambda r=r: tx.WeightSync(stores.client(), "q", "target", r, (n, m), targets[r], token="k",
                                   transport=transport, timeout=30, **kw) for r in range(m)]), stores]


def step(syncs: list[Any], n: int) -> list[Any]:
    return run_ranks([s.push for s in syncs[:n]] + [lambda t=t: t.wait(timeout=60) for t in syncs[n:-1]])


def close(syncs: list[Any]) -> None:
    for s in syncs[:-1]:
        s.close()


LAYOUTS = [Quantization.blocks(), Quantization.blocks(1, 128, "deepgemm"), Quantization.per_channel(),
           Quantization.mxfp8(), Quantization((128, 128), "deepgemm", "e8m0")]


@pytest.mark.parametrize("q", LAYOUTS, ids=lambda q: q.tag.replace("/", "-"))
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_uneven_fp32_shards_land_in_column_parallel_fp8_targets_byte_for_byte(q: Quantization, transport: str) -> None:
    shapes = {"w": (768, 384), "u": (256, 640)}
    n, m = 5, 2         # 5 row shards of 154 / 52 rows: most blocks straddle two sources
    w0 = weights(0, shapes)
    sources = [row_shards(w0, r, n) for r in range(n)]
    targets = []
    for t in range(m):
        tensors = {}
        for name, shape in shapes.items():
            box = chunk_box(shape, 0, t, m)
            grid = q.grid(shape)
            scale_shape = (box.sizes[0] // grid.block[0], grid.scale_shape[1])
            tensors[name] = Target.shard(torch.zeros(box.sizes, dtype=torch.float8_e4m3fn), name, shape, 0, t,
                                         m).quantized(q, scale_tensor(q, scale_shape))
        targets.append(tensors)
    syncs = group(sources, targets, transport)
    try:
        for version in (1, 2):
            w = weights(version, shapes)
            for r in range(n):
                for name, src in row_shards(w, r, n).items():
                    sources[r][name].tensor.copy_(src.tensor)
            results = step(syncs, n)
            assert results[n:] == [version] * m
            for name in shapes:
                want_values, want_scales = reference(w[name], q)
                got_values = torch.cat([targets[t][name].tensor for t in range(m)])
                got_scales = torch.cat([targets[t][name].scales for t in range(m)])
                assert same(got_values, want_values), (version, name)
                assert same(got_scales, want_scales), (version, name)
        stats = results[:n]
        # the wire carries FP8 values and scales: a quarter of these fp32 shards' bytes, plus the scales
        for r, st in enumerate(stats):
            fp32 = sum(s.tensor.numel() * 4 for s in sources[r].values())
            assert st.bytes < fp32 // 4 + 4096 and st.quantized.values_bytes == fp32 // 4, st.as_dict()
        if q.block[0] != 1:     # row blocks cut by the shards: shared, agreed in one round with the neighbours
            assert all(st.quantized.shared_blocks and st.quantized.peers >= 1 for st in stats), stats
        else:                   # one-row blocks never straddle a row cut: nothing to agree
            assert not any(st.quantized.shared_blocks or st.quantized.peers for st in stats)
        # the targets' FP8 weights and scales are views of their regions: the bytes landed in the live tensors
        for s, tt in zip(syncs[n:-1], targets):
            views = s.region.tensors(framework="torch")
            assert all(tt[k].tensor.data_ptr() == views[k].data_ptr() and
                       tt[k].scales.data_ptr() == views[f"{k}_scale_inv"].data_ptr() for k in tt)
    finally:
        close(syncs)


def test_a_per_tensor_scale_split_over_two_sources_is_agreed_and_replicated_on_every_target() -> None:
    q = Quantization.per_tensor()
    shape = (200, 96)
    w = weights(3, {"w": shape})
    w["w"][150, 3] = 0.9        # the tensor's amax lies in source 1's rows
    sources = [row_shards(w, r, 2) for r in range(2)]
    targets = [{"w": Target.shard(torch.zeros(100, 96, dtype=torch.float8_e4m3fn), "w", shape, 0, t, 2)
                .quantized(q, torch.zeros(1))} for t in range(2)]
    syncs = group(sources, targets)
    try:
        step(syncs, 2)
        want_values, want_scales = reference(w["w"], q)
        assert same(torch.cat([t["w"].tensor for t in targets]), want_values)
        assert all(same(t["w"].scales, want_scales) for t in targets)
        assert want_scales.item() == pytest.approx(0.9 / 448)
    finally:
        close(syncs)


def test_stacked_moe_experts_split_over_targets_from_per_expert_sources() -> None:
    """vLLM's fused MoE: ``w13`` = [experts, 2 * I, H] (gate and up stacked), ``w2`` = [experts, H, I],
    experts split over the targets (EP); each source holds whole experts, as a per-expert trainer does."""
    q = Quantization.blocks()
    experts, hidden, inter = 4, 256, 128
    shapes = {f"e{e}.{p}": ((hidden, inter) if p == "down" else (inter, hidden))
              for e in range(experts) for p in ("gate", "up", "down")}
    w = weights(5, shapes, torch.bfloat16)
    sources = [{n: Source(t.clone(), tuple(t.shape), Box((0, 0), tuple(t.shape)), adopt=False)
                for n, t in w.items() if int(n[1]) % 2 == r} for r in range(2)]
    targets = []
    for t in range(2):
        mine = [e for e in range(experts) if e // 2 == t]
        w13 = torch.zeros(len(mine), 2 * inter, hidden, dtype=torch.float8_e4m3fn)
        w2 = torch.zeros(len(mine), hidden, inter, dtype=torch.float8_e4m3fn)
        p13 = [Piece(f"e{e}.{p}", Box((0, 0), (inter, hidden)), (i, j * inter, 0))
               for i, e in enumerate(mine) for j, p in enumerate(("gate", "up"))]
        p2 = [Piece(f"e{e}.down", Box((0, 0), (hidden, inter)), (i, 0, 0)) for i, e in enumerate(mine)]
        targets.append({
            "w13": Target(w13, tuple(p13)).quantized(q, torch.zeros(len(mine), 2, 2),
                                                     [(inter, hidden)] * len(p13)),
            "w2": Target(w2, tuple(p2)).quantized(q, torch.zeros(len(mine), 2, 1), [(hidden, inter)] * len(p2))})
    syncs = group(sources, targets)
    try:
        step(syncs, 2)
        for t, tensors in enumerate(targets):
            for i, e in enumerate(e for e in range(experts) if e // 2 == t):
                for j, p in enumerate(("gate", "up")):
                    v, s = reference(w[f"e{e}.{p}"], q)
                    assert same(tensors["w13"].tensor[i, j * inter:(j + 1) * inter], v)
                    assert same(tensors["w13"].scales[i, j:j + 1], s)
                v, s = reference(w[f"e{e}.down"], q)
                assert same(tensors["w2"].tensor[i], v) and same(tensors["w2"].scales[i], s)
    finally:
        close(syncs)


def test_one_tensor_served_in_bf16_to_one_target_and_fp8_to_another() -> None:
    q = Quantization.blocks()
    shape = (256, 256)
    w = weights(7, {"w": shape})
    sources = [row_shards(w, r, 3) for r in range(3)]
    bf16 = {"w": Target.whole(torch.zeros(shape, dtype=torch.bfloat16), "w")}
    fp8 = {"w": Target.whole(torch.zeros(shape, dtype=torch.float8_e4m3fn), "w").quantized(q, torch.zeros(2, 2))}
    syncs = group(sources, [bf16, fp8])
    try:
        step(syncs, 3)
        assert torch.equal(bf16["w"].tensor, w["w"].to(torch.bfloat16))
        want_values, want_scales = reference(w["w"], q)
        assert same(fp8["w"].tensor, want_values) and same(fp8["w"].scales, want_scales)
    finally:
        close(syncs)


def test_a_nan_in_one_source_fails_the_step_on_every_target_naming_the_tensor_and_the_next_push_lands() -> None:
    q = Quantization.blocks()
    shapes = {"layers.0.w": (512, 256), "layers.1.w": (256, 256)}
    w = weights(1, shapes)
    sources = [row_shards(w, r, 3) for r in range(3)]
    targets = [{n: Target.shard(torch.zeros(s[0] // 2, s[1], dtype=torch.float8_e4m3fn), n, s, 0, t, 2)
                .quantized(q, torch.zeros(s[0] // 256, s[1] // 128)) for n, s in shapes.items()} for t in range(2)]
    syncs = group(sources, targets, stall_timeout=5)
    try:
        step(syncs, 3)
        sources[1]["layers.0.w"].tensor[10, 20] = float("nan")        # rows 181..351: blocks shared with 0 and 2
        results = [r[0] for r in run_ranks([lambda s=s: [_catch(s.push)] for s in syncs[:3]] +
                                           [lambda t=t: [_catch(lambda: t.wait(timeout=30))] for t in syncs[3:-1]])]
        for r in results:
            assert isinstance(r, tx.QuantizationError), results
            assert r.tensor == "layers.0.w" and "NaN" in str(r), r
        sources[1]["layers.0.w"].tensor.copy_(row_shards(w, 1, 3)["layers.0.w"].tensor)
        results = step(syncs, 3)
        assert results[3:] == [3, 3]
        for n in shapes:
            want_values, want_scales = reference(w[n], q)
            assert same(torch.cat([t[n].tensor for t in targets]), want_values)
            assert same(torch.cat([t[n].scales for t in targets]), want_scales)
    finally:
        close(syncs)


@pytest.mark.parametrize("make, match", [
    (lambda: Target.shard(torch.zeros(100, 256, dtype=torch.float8_e4m3fn), "w", (200, 256), 0, 0, 2)
     .quantized(Quantization.blocks(), torch.zeros(1, 2)), "'w'.* does not hold whole blocks"),
    (lambda: Target.shard(torch.zeros(128, 256, dtype=torch.bfloat16), "w", (256, 256), 0, 0, 2)
     .quantized(Quantization.blocks(), torch.zeros(1, 2)), "values tensor is BF16"),
    (lambda: Target.shard(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), "w", (256, 256), 0, 0, 2)
     .quantized(Quantization.blocks(), torch.zeros(1, 2, dtype=torch.bfloat16)), "scales tensor is BF16"),
    (lambda: Target.shard(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), "w", (256, 256), 0, 0, 2)
     .quantized(Quantization.blocks(), torch.zeros(2, 2)), r"'w'.*needs \(1, 2\)"),
    # named by the tensors it serves (a fused target: each of its parts), before the WeightSync names it
    (lambda: Target.fused(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), [("q", (128, 256)), ("k", (128, 256))],
                          0, 0, 1).quantized(Quantization.blocks(), torch.zeros(1, 2)), r"'q\+k'.*needs \(2, 2\)"),
    (lambda: Target.whole(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), "w")
     .quantized(Quantization.blocks(), np.zeros((1, 2), np.float32)), "scales must be a torch tensor.*ndarray"),
    (lambda: Target.whole(torch.zeros(300, dtype=torch.float8_e4m3fn), "bias")
     .quantized(Quantization.blocks(), torch.zeros(3, 1)), "'bias' of shape .300,. has fewer dimensions"),
    (lambda: Target(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), (Piece("w", Box((0, 0), (128, 256)), (0, 0)),))
     .quantized(Quantization.blocks(), torch.zeros(1, 2)), "global shape"),
])
def test_a_target_layout_that_does_not_fit_is_refused_when_described(make: Any, match: str) -> None:
    with pytest.raises(tx.PlanError, match=match):
        make()


def test_fp8_asked_of_an_integer_tensor_is_refused_before_any_byte_moves() -> None:
    shape = (128, 256)
    source = {"w": Source(torch.zeros(shape, dtype=torch.int32), shape, Box((0, 0), shape))}
    target = {"w": Target.whole(torch.zeros(shape, dtype=torch.float8_e4m3fn), "w")
              .quantized(Quantization.blocks(), torch.zeros(1, 2))}
    stores = Stores()
    results = [r[0] for r in run_ranks([
        lambda: [_catch(lambda: tx.WeightSync(stores.client(), "q", "source", 0, (1, 1), source, token="k",
                                              transport="tcp", timeout=5))],
        lambda: [_catch(lambda: tx.WeightSync(stores.client(), "q", "target", 0, (1, 1), target, token="k",
                                              transport="tcp", timeout=5))]])]
    assert isinstance(results[0], tx.PlanError), results[0]
    assert "'w' is I32" in str(results[0]) and "floating-point" in str(results[0])
    # the target is told why the group cannot form (not a timeout naming ranks that did register)
    assert isinstance(results[1], tx.TransferError) and not isinstance(results[1], tx.TransferTimeout), results[1]
    assert "source rank 0 failed as it started (PlanError" in str(results[1]) and "'w' is I32" in str(results[1])
    # the same group started again, fixed: the old failure in the store does not stop it
    fixed = {"w": Source(torch.zeros(shape), shape, Box((0, 0), shape))}
    target = {"w": Target.whole(torch.zeros(shape, dtype=torch.float8_e4m3fn), "w")
              .quantized(Quantization.blocks(), torch.zeros(1, 2))}
    syncs = run_ranks([
        lambda: tx.WeightSync(stores.client(), "q", "source", 0, (1, 1), fixed, token="k", transport="tcp", timeout=30),
        lambda: tx.WeightSync(stores.client(), "q", "target", 0, (1, 1), target, token="k", transport="tcp",
                              timeout=30)])
    try:
        assert step([*syncs, stores], 1)[1:] == [1]
    finally:
        close([*syncs, stores])


def test_blocks_with_more_dimensions_than_the_tensor_are_refused_when_described() -> None:
    tensor = torch.zeros(1, 128, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(tx.PlanError, match="do not fit"):
        Target(tensor, (Piece("w", Box((0, 0), (128, 256)), (0, 0, 0)),), ((128, 256),)).quantized(
            Quantization((1, 128, 128)), torch.zeros(1, 1, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("q", [Quantization.blocks(), Quantization((128, 128), "deepgemm", "e8m0")],
                         ids=lambda q: q.tag.replace("/", "-"))
def test_gpu_shards_are_quantized_by_the_kernels_and_land_over_ipc(q: Quantization) -> None:
    from tests.helpers import GPU_REASON

    if GPU_REASON is not None or not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA GPU: {GPU_REASON or 'torch sees none'}")
    from tensorxfer.quant import kernel

    shapes = {"w": (1024, 512), "u": (512, 1536)}
    n, m = 3, 2
    w = weights(2, shapes, torch.bfloat16)
    sources = [{name: Source(s.tensor.cuda(), s.global_shape, s.box, adopt=False)
                for name, s in row_shards(w, r, n).items()} for r in range(n)]
    assert kernel.fits(sources[0]["w"].tensor, q.grid(shapes["w"]))
    targets = []
    for t in range(m):
        tensors = {}
        for name, shape in shapes.items():
            box = chunk_box(shape, 0, t, m)
            tensors[name] = Target.shard(torch.zeros(box.sizes, dtype=torch.float8_e4m3fn, device="cuda"), name,
                                         shape, 0, t, m).quantized(q, scale_tensor(q, (box.sizes[0] // 128,
                                                                                       -(-shape[1] // 128))).cuda())
        targets.append(tensors)
    syncs = group(sources, targets, "ipc")
    try:
        for version in (1, 2):
            if version == 2:
                for r in range(n):
                    for name in shapes:
                        sources[r][name].tensor.mul_(-1.5)
                w = {name: t * -1.5 for name, t in w.items()}
            assert step(syncs, n)[n:] == [version] * m
            for name in shapes:
                want_values, want_scales = reference(w[name], q)
                assert same(torch.cat([targets[t][name].tensor for t in range(m)]).cpu(), want_values)
                assert same(torch.cat([targets[t][name].scales for t in range(m)]).cpu(), want_scales)
    finally:
        close(syncs)


def test_a_padded_vocab_parallel_head_is_filled_once_and_its_padding_never_planned() -> None:
    """vLLM pads a 1000-row vocabulary to 1024 and gives each of 2 ranks 512 rows: rank 1's last 24 rows
    are padding no source holds.  They are zeroed at construction, never sent; the real rows land."""
    shape = (1000, 64)
    w = weights(9, {"lm_head": shape})
    sources = [row_shards(w, r, 3) for r in range(3)]
    targets = [{"lm_head": Target.vocab_parallel(torch.full((512, 64), 7.0), "lm_head", shape, t, 2)}
               for t in range(2)]
    assert [p.is_filled for p in targets[1]["lm_head"].pieces] == [False, True]
    syncs = group(sources, targets)
    try:
        stats = step(syncs, 3)
        assert torch.equal(torch.cat([t["lm_head"].tensor for t in targets])[:1000], w["lm_head"])
        assert not targets[1]["lm_head"].tensor[488:].any()         # the padding: zeroed, not left at 7
        assert sum(s.bytes for s in stats[:3]) == 1000 * 64 * 4     # the padding is not on the wire
    finally:
        close(syncs)
    with pytest.raises(tx.PlanError, match="does not split"):
        Target.vocab_parallel(torch.zeros(500, 64), "lm_head", (1000, 64), 0, 3)
    with pytest.raises(tx.PlanError, match="padded rows need"):
        Target.vocab_parallel(torch.zeros(500, 64), "lm_head", (1000, 64), 0, 2)


def test_a_target_asking_a_layout_no_source_makes_is_told_which_ones_they_make() -> None:
    """A target that joins later with another block shape: the plan is refused before any byte moves,
    naming the tensor, the layout it asked and the layouts the sources make."""
    from tensorxfer.quant import derived_name
    from tensorxfer.sync import RankSpec, SourceTensor, TargetTensor, plan
    from tensorxfer.sync.quantized_spec import quantized_target

    made, asked = Quantization.blocks(128, 128), Quantization.blocks(1, 128)
    shape = (256, 256)
    source = RankSpec("source", 0, [
        SourceTensor(derived_name("w", made, "values"), shape, "F8_E4M3", Box((0, 0), shape), 0),
        SourceTensor(derived_name("w", made, "scales"), (2, 2), "F32", Box((0, 0), (2, 2)), 1 << 20)])
    values = TargetTensor("w", shape, "F8_E4M3", 0, (Piece("w", Box((0, 0), shape), (0, 0)),))
    target = RankSpec("target", 0, quantized_target(values, [shape], asked, "w_scale_inv", (256, 2), 1 << 20))
    with pytest.raises(tx.PlanError) as info:
        plan([source], [target])
    message = str(info.value)
    assert "'w' (FP8 E4M3, 1x128 blocks" in message and "the sources make it as: FP8 E4M3, 128x128 blocks" in message
    assert "\x00" not in message


# ---- the shared-block bookkeeping, against brute force ----------------------------------------------------


@st.composite
def sharded(draw: Any) -> tuple[tuple[int, int], Quantization, list[Box]]:
    """A 2-D tensor, a block layout, and shards cut along rows or columns at arbitrary points."""
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    block = (draw(st.sampled_from([1, 2, 3, 8, None])), draw(st.sampled_from([1, 4, 5, 16, None])))
    q = Quantization(block) if draw(st.booleans()) else Quantization.per_tensor()
    dim = draw(st.integers(0, 1))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, shape[dim] - 1)), max_size=4))) - {shape[dim]})
    edges = [0, *[c for c in cuts if 0 < c < shape[dim]], shape[dim]]
    boxes = [Box(tuple(a if d == dim else 0 for d in range(2)),
                 tuple(b - a if d == dim else shape[d] for d in range(2))) for a, b in itertools.pairwise(edges)]
    if draw(st.booleans()):     # a replica of one shard (HSDP): it holds nothing a peer needs from it
        boxes.append(boxes[draw(st.integers(0, len(boxes) - 1))])
    return shape, q, boxes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sharded())
def test_shared_cells_bytes_and_peers_match_brute_force(case: Any) -> None:
    import numpy as np

    from tensorxfer.quant import derived_name
    from tensorxfer.sync import RankSpec, SourceTensor
    from tensorxfer.sync.quantizing import QuantizedShard, SourceQuantizer

    shape, q, boxes = case
    grid = q.grid(shape)
    holds = np.zeros((len(boxes), *shape), dtype=bool)
    for r, b in enumerate(boxes):
        holds[r, b.offsets[0]:b.offsets[0] + b.sizes[0], b.offsets[1]:b.offsets[1] + b.sizes[1]] = True
    shards = [QuantizedShard("w", shape, b.offsets, q, torch.empty(b.sizes), torch.empty(0), torch.empty(0))
              for b in boxes]
    cell_rows = [slice(c * grid.block[0], (c + 1) * grid.block[0]) for c in range(grid.scale_shape[0])] \
        if not grid.per_tensor else [slice(None)]
    cell_cols = [slice(c * grid.block[1], (c + 1) * grid.block[1]) for c in range(grid.scale_shape[-1])] \
        if not grid.per_tensor else [slice(None)]
    for r, s in enumerate(shards):
        want_ids, want_bytes, want_peers = [], 0, set()
        for i, rows in enumerate(cell_rows):
            for j, cols in enumerate(cell_cols):
                mine, outside = holds[r, rows, cols], ~holds[r, rows, cols]
                if mine.any() and outside.any():
                    want_ids.append(0 if grid.per_tensor else i * grid.scale_shape[1] + j)
                    want_bytes += int(mine.sum())
                    want_peers |= {k for k in range(len(boxes)) if k != r and (holds[k, rows, cols] & outside).any()}
        assert s.shared_ids.tolist() == want_ids, (r, boxes)
        assert s.shared_bytes == want_bytes, (r, boxes)
        specs = [RankSpec("source", k, [SourceTensor(derived_name("w", q, "values"), shape, "F8_E4M3", b, 0)])
                 for k, b in enumerate(boxes)]
        quantizer = SourceQuantizer([s], None, r, 1.0)     # type: ignore[arg-type]  (plan reads no store)
        quantizer.plan(specs)
        assert set(quantizer._peers) == want_peers, (r, boxes)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sharded(), st.integers(0, 2**31))
def test_a_round_folds_the_peers_records_into_whole_block_amaxes_and_refuses_forged_ones(case: Any, seed: int) -> None:
    import numpy as np

    from tensorxfer.errors import StoreError
    from tensorxfer.sync.quantizing import QuantizedShard, _RoundIndex
    from tensorxfer.sync.records import Amaxes

    shape, q, boxes = case
    grid = q.grid(shape)
    rng = np.random.default_rng(seed)
    values = {name: np.abs(rng.standard_normal(shape)).astype(np.float32) for name in ("w", "v")}

    def cell_amax(name: str, cell: int, box: Box | None) -> float:
        """The amax of one cell of ``name`` over ``box``'s part of it (None: the whole block)."""
        i, j = (0, 0) if grid.per_tensor else divmod(cell, grid.scale_shape[1])
        b = shape if grid.per_tensor else grid.block
        held = np.zeros(shape, dtype=bool)
        held[i * b[0]:(i + 1) * b[0], j * b[1]:(j + 1) * b[1]] = True
        if box is not None:
            inside = np.zeros(shape, dtype=bool)
            inside[box.offsets[0]:box.offsets[0] + box.sizes[0], box.offsets[1]:box.offsets[1] + box.sizes[1]] = True
            held &= inside
        return float(values[name][held].max()) if held.any() else 0.0

    def round_of(box: Box) -> tuple[_RoundIndex, np.ndarray]:
        shards = [QuantizedShard(name, shape, box.offsets, q, torch.empty(box.sizes), torch.empty(0), torch.empty(0))
                  for name in ("w", "v")]
        index = _RoundIndex([s for s in shards if not s.empty and len(s.shared_ids)])
        flat = np.array([cell_amax(s.name, int(c), box) for s in index.shards for c in s.shared_ids], np.float32)
        return index, flat

    rounds = [round_of(b) for b in boxes]
    for r, (index, flat) in enumerate(rounds):
        folded = flat.copy()
        for k, (peer, theirs) in enumerate(rounds):
            if k != r:
                index.fold(folded, peer.record(theirs), f"amax/{k}")
        want = [cell_amax(s.name, int(c), None) for s in index.shards for c in s.shared_ids]
        assert folded.tolist() == want, (r, boxes)
        assert [m.tolist() for m in index.split(folded)] == [
            [cell_amax(s.name, int(c), None) for c in s.shared_ids] for s in index.shards]
        if not len(flat):
            continue
        # ids that are no cell of ours, and tensors we hold no shared cell of, are passed over
        stray = Amaxes({index.shards[0].key: (np.array([-1, 2**40 + int(index.shards[0].shared_ids[0]), 10**6],
                                                       "<i8").tobytes(), np.full(3, 1e9, "<f4").tobytes()),
                        "other.weight_scale_inv": (np.zeros(1, "<i8").tobytes(), np.full(1, 1e9, "<f4").tobytes())})
        before = folded.copy()
        index.fold(folded, stray, "amax/stray")
        assert folded.tolist() == before.tolist()
        for bad in (-1.0, float("nan"), float("inf")):
            forged = Amaxes({index.shards[-1].key: (index.ids_bytes[-1],
                                                    np.full(len(index.shards[-1].shared_ids), bad, "<f4").tobytes())})
            with pytest.raises(StoreError, match=f"amaxes of {index.shards[-1].name!r} that are no amaxes"):
                index.fold(folded, forged, "amax/forged")
