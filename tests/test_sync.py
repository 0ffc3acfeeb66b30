"""WeightSync end to end in one process (ranks in threads, a real TCPStore): N sources sharded one way, M
targets another way, every step's bytes straight into the targets' live tensors."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import tensorxfer as tx
from tensorxfer.sync import Source, Target
from tensorxfer.sync.rendezvous import open_tcp_store

torch = pytest.importorskip("torch", reason="the weight sync's examples are torch tensors")

SHAPES = {"w": (12, 10), "o": (10, 12), "q": (8, 10), "k": (4, 10), "v": (4, 10), "norm": (10,)}


def global_tensors(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


class Stores:
    """One TCPStore server, and a client of its own for every rank (as each rank's process would have)."""

    def __init__(self) -> None:
        self.server = open_tcp_store("127.0.0.1", 0, True)

    def client(self) -> Any:
        return open_tcp_store("127.0.0.1", self.server.port, False)


def run_ranks(fns: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def one_to_one(stores: Stores, group: str, srcs: dict[str, Any], tgts: dict[str, Any], **kw: Any) -> list[Any]:
    """One source rank and one target rank of ``group`` over tcp, formed: [source, target]."""
    return run_ranks([
        lambda: tx.WeightSync(stores.client(), group, "source", 0, (1, 1), srcs, transport="tcp", timeout=20, **kw),
        lambda: tx.WeightSync(stores.client(), group, "target", 0, (1, 1), tgts, transport="tcp", timeout=20, **kw)])


def source_tensors(rank: int, n: int, g: dict[str, Any], device: str = "cpu") -> dict[str, Source]:
    """FSDP-style: every tensor chunked along dim 0 over the sources (uneven, as torch.chunk cuts)."""
    out = {}
    for name, t in g.items():
        box = tx.sync.chunk_box(t.shape, 0, rank, n)
        local = t[box.offsets[0]:box.offsets[0] + box.sizes[0]].clone().to(device)
        out[name] = Source(local, tuple(t.shape), box)
    return out


def target_tensors(rank: int, m: int, dtype: Any, device: str = "cpu") -> dict[str, Target]:
    """TP-style: w column-parallel, o row-parallel, qkv fused, norm replicated."""
    def empty(*shape: int) -> Any:
        return torch.zeros(shape, dtype=dtype, device=device)
    w_rows = len(range(12)[rank * 6:(rank + 1) * 6]) if m == 2 else 12
    return {
        "w": Target.shard(empty(w_rows if m == 2 else 12 // m, 10), "w", SHAPES["w"], 0, rank, m),
        "o": Target.shard(empty(10, 12 // m), "o", SHAPES["o"], 1, rank, m),
        "qkv": Target.fused(empty(16 // m, 10), [("q", SHAPES["q"]), ("k", SHAPES["k"]), ("v", SHAPES["v"])], 0,
                            rank, m),
        "norm": Target.whole(empty(10), "norm"),
    }


def expected_target(rank: int, m: int, g: dict[str, Any]) -> dict[str, Any]:
    def chunk(t: Any, dim: int) -> Any:
        return torch.chunk(t, m, dim)[rank]
    return {"w": chunk(g["w"], 0), "o": chunk(g["o"], 1),
            "qkv": torch.cat([chunk(g["q"], 0), chunk(g["k"], 0), chunk(g["v"], 0)]), "norm": g["norm"]}


@pytest.mark.parametrize("transport, n, m, dtype", [("tcp", 2, 2, torch.float32), ("ipc", 3, 2, torch.bfloat16),
                                                     ("tcp", 1, 2, torch.float32), ("ipc", 2, 1, torch.float32)])
def test_sources_sharded_one_way_land_in_targets_sharded_another(transport: str, n: int, m: int, dtype: Any,
                                                                 device: str = "cpu",
                                                                 copy_host: bool | None = None) -> None:
    stores = Stores()
    g0 = global_tensors(0)
    src_tensors = [source_tensors(r, n, g0, device) for r in range(n)]
    tgt_tensors = [target_tensors(r, m, dtype, device) for r in range(m)]
    syncs = run_ranks(
        [lambda r=r: tx.WeightSync(stores.client(), "t", "source", r, (n, m), src_tensors[r], token="k",
                                   transport=transport, timeout=30) for r in range(n)] +
        [lambda r=r: tx.WeightSync(stores.client(), "t", "target", r, (n, m), tgt_tensors[r], token="k",
                                   transport=transport, timeout=30, copy_host=copy_host) for r in range(m)])
    sources, targets = syncs[:n], syncs[n:]
    try:
        for step in (0, 1, 2):
            g = global_tensors(step)
            for r in range(n):               # the trainer's step changed its shards in place
                for name, src in source_tensors(r, n, g, device).items():
                    src_tensors[r][name].tensor.copy_(src.tensor)
            results = run_ranks([s.push for s in sources] + [lambda t=t: t.wait(timeout=60) for t in targets])
            assert results[n:] == [step + 1] * m
            for r in range(m):
                want = expected_target(r, m, g)
                for name, target in tgt_tensors[r].items():
                    assert torch.equal(target.tensor.cpu(), want[name].to(dtype)), (step, r, name)
            stats = results[0]
            assert stats.version == step + 1 and {p.transport for p in stats.pairs} == {transport}
            # shards already in the targets' dtype were adopted (no copy at a push); the others are cast in
            assert (stats.packed_bytes == 0) == (dtype == torch.float32), stats.packed_bytes
        # the data paths were set up once: later steps set nothing up
        assert not any(p.setup for p in results[0].pairs)
        # adopted source shards are views of their rank's region
        if dtype == torch.float32:
            for s, st in zip(sources, src_tensors):
                views = s.region.tensors(framework="torch")
                assert s.adopted == len(st) and all(st[k].tensor.data_ptr() == views[k].data_ptr() for k in st)
        # every target tensor is a view of its region (the updates landed in the live tensors)
        for t, tt in zip(targets, tgt_tensors):
            views = t.region.tensors(framework="torch")
            assert all(tt[k].tensor.data_ptr() == views[k].data_ptr() for k in tt)
        # targets on one device (GPU: by default) copied through one of them: a lane per follower pair
        hosts = [t._copy_host for t in targets if t._copy_host is not None]
        hosted = transport == "ipc" and (copy_host or (copy_host is None and device != "cpu")) and m > 1
        assert len(hosts) == hosted and (not hosted or hosts[0].lanes_served == n * (m - 1)), hosts
        # ... and maps no lane's region larger than the group's largest (the descriptions' payloads)
        assert not hosted or hosts[0].limit_bytes == max(s.region.nbytes for s in syncs), hosts[0].limit_bytes
    finally:
        for s in syncs:
            s.close()
    if hosted:      # every step of every follower pair was copied by the host (a lane's run of steps counts
        assert hosts[0].copies == 3 * n * (m - 1)       # once it ends: here, with the sync)


def test_targets_on_one_device_can_copy_through_one_of_them() -> None:
    test_sources_sharded_one_way_land_in_targets_sharded_another("ipc", 3, 2, torch.float32, copy_host=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_ranks_over_ipc_land_through_the_strided_copy_kernel(dtype: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tensorxfer.memory import strided

    assert strided.kernel_image() is not None, "strided_copy.fatbin was not built"
    test_sources_sharded_one_way_land_in_targets_sharded_another("ipc", 3, 2, dtype, "cuda:0")


@pytest.mark.rdma
def test_two_sources_to_two_targets_over_rdma() -> None:
    from tensorxfer.transport.rdma import rdma_available

    ok, reason = rdma_available()
    if not ok:
        pytest.skip(f"no usable RDMA device: {reason}")
    test_sources_sharded_one_way_land_in_targets_sharded_another("rdma", 2, 2, torch.float32)


def test_an_adopted_shard_the_trainer_re_points_is_copied_in_never_sent_stale() -> None:
    stores = Stores()
    g = global_tensors(0)
    srcs = {"w": Source(g["w"].clone(), SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 1)),
            "o": Source(g["o"].clone(), SHAPES["o"], tx.sync.chunk_box(SHAPES["o"], 0, 0, 1), adopt=False)}
    tgts = {"w": Target.whole(torch.zeros(12, 10), "w"), "o": Target.whole(torch.zeros(10, 12), "o")}
    source, target = one_to_one(stores, "a", srcs, tgts)
    try:
        assert source.adopted == 1, "the plain shard is adopted, the one marked adopt=False is not"
        w, o = srcs["w"].tensor, srcs["o"].tensor
        stats, _ = run_ranks([source.push, lambda: target.wait(timeout=20)])
        assert stats.packed_bytes == o.numel() * 4, "only the shard that is not adopted is copied in"
        w.data = torch.full_like(w, 3.0)     # the trainer swaps the parameter's storage (not in place)
        o.mul_(2)
        stats, _ = run_ranks([source.push, lambda: target.wait(timeout=20)])
        assert stats.packed_bytes == (w.numel() + o.numel()) * 4
        assert torch.equal(tgts["w"].tensor, w) and torch.equal(tgts["o"].tensor, o)
    finally:
        source.close()
        target.close()


def test_a_shard_the_trainer_replaced_with_another_shape_fails_the_push_naming_it() -> None:
    """The plan is made for each shard's shape; a trainer that swaps a shard for one of another size (a resized
    embedding) gets a PlanError naming it from push, and the next push with the right shape lands."""
    stores = Stores()
    w = torch.nn.Parameter(global_tensors(0)["w"].clone())
    srcs = {"w": Source(w, SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 1))}
    tgts = {"w": Target.whole(torch.zeros(12, 10), "w")}
    source, target = one_to_one(stores, "z", srcs, tgts)
    try:
        w.data = torch.zeros(13, 10)
        (pushed,), (waited,) = run_ranks([lambda: [_catch(source.push)],
                                          lambda: [_catch(lambda: target.wait(timeout=20))]])
        assert isinstance(pushed, tx.PlanError) and "'w' now has shape (13, 10)" in str(pushed), pushed
        assert isinstance(waited, tx.TransferError), waited
        w.data = torch.full((12, 10), 5.0)
        _, version = run_ranks([source.push, lambda: target.wait(timeout=20)])
        assert version == 2 and torch.equal(tgts["w"].tensor, w.detach())
    finally:
        source.close()
        target.close()


@pytest.mark.parametrize("kw, match", [
    ({"tensors": {}}, "at least one tensor"), ({"role": "trainer"}, "role must be"),
    ({"rank": 1}, r"world=\(1, 1\) has no source rank 1"), ({"world": (0, 1)}, "has no source rank 0"),
    ({"timeout": -1}, "^timeout is seconds > 0, got -1"),
    ({"stall_timeout": float("nan")}, "stall_timeout is seconds > 0"),
])
def test_a_sync_built_with_arguments_that_cannot_work_is_refused_at_once(kw: dict, match: str) -> None:
    """Refused in the constructor, before it touches the store (a negative timeout was a wait that ended at
    once, reported as ranks that did not register)."""
    args = {"role": "source", "rank": 0, "world": (1, 1), "tensors": {"w": Source.whole(torch.zeros(2))}, **kw}
    with pytest.raises(ValueError, match=match):
        tx.WeightSync("tcp://127.0.0.1:1", "bad", timeout=kw.get("timeout", 5),
                      **{k: v for k, v in args.items() if k != "timeout"})


def test_a_closed_sync_says_so_and_a_rank_asked_the_other_roles_call_says_which_it_is() -> None:
    stores = Stores()
    w = global_tensors(0)["w"].clone()
    source, target = one_to_one(stores, "c", {"w": Source(w, SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 1))},
                                {"w": Target.whole(torch.zeros(12, 10), "w")})
    with pytest.raises(TypeError, match=r"push\(\) is for source ranks; this is a target rank"):
        target.push()
    with pytest.raises(TypeError, match=r"wait\(\) is for target ranks; this is a source rank"):
        source.wait()
    for sync, call in ((source, source.push), (target, lambda: target.wait(timeout=1))):
        sync.close()
        sync.close()        # idempotent
        with pytest.raises(tx.RegionClosed, match="on a closed WeightSync"):
            call()


@pytest.mark.parametrize("given", ["data", "view"])
def test_a_shard_given_as_a_parameters_data_or_a_view_is_packed_and_the_trainers_steps_land(given: str) -> None:
    """A trainer that passes ``param.data`` (or a view of a larger tensor) and steps the parameter in place:
    re-pointing what it passed would leave the parameter behind and send the first push's weights at every
    push after.  Such a shard is not adopted: it is copied in at each push, and each push lands the
    parameter's weights; a parameter passed itself is still adopted."""
    stores = Stores()
    g = global_tensors(0)
    w = torch.nn.Parameter(g["w"].clone())
    big = torch.cat([g["o"].clone(), torch.zeros(10, 12)], 1)       # o lives in the first 12 columns
    o = {"data": torch.nn.Parameter(g["o"].clone()), "view": big[:, :12]}[given]
    srcs = {"w": Source(w, SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 1)),
            "o": Source(o.data if given == "data" else o, SHAPES["o"], tx.sync.chunk_box(SHAPES["o"], 0, 0, 1))}
    tgts = {"w": Target.whole(torch.zeros(12, 10), "w"), "o": Target.whole(torch.zeros(10, 12), "o")}
    source, target = one_to_one(stores, "p", srcs, tgts)
    try:
        assert source.adopted == 1, "the parameter passed itself is adopted, the shared one is not"
        for step in (1, 2):
            with torch.no_grad():       # the optimizer's step: in place, on the trainer's own tensors
                w.mul_(2)
                (o if given == "data" else big).add_(1)
            stats, _ = run_ranks([source.push, lambda: target.wait(timeout=20)])
            assert stats.packed_bytes == o.numel() * 4, step
            assert torch.equal(tgts["w"].tensor, w.detach()) and torch.equal(tgts["o"].tensor, o.detach()), step
    finally:
        source.close()
        target.close()


@pytest.mark.parametrize("given", ["data", "view", "base of a live view"])
def test_a_target_tensor_that_shares_its_memory_is_refused_naming_it(given: str) -> None:
    """A target's tensors are moved into its region and re-pointed there: a tensor that shares its memory
    with another (a parameter's ``.data``, a view, a tensor with a view of it alive) would leave the other --
    the weight the engine reads -- with the old bytes for good.  Refused when the group forms, named."""
    param = torch.nn.Parameter(torch.zeros(12, 10))
    big = torch.zeros(12, 20)
    held = torch.zeros(12, 10)
    kept = held[:6]      # noqa: F841  (alive for the test: the engine's view of its weight)
    tensor = {"data": param.data, "view": big[:, :10], "base of a live view": held}[given]
    stores = Stores()
    with pytest.raises(tx.BindingError, match=r"'w' shares its memory.*the nn.Parameter itself") as caught:
        tx.WeightSync(stores.client(), "s", "target", 0, (1, 1), {"w": Target.whole(tensor, "w")}, timeout=20)
    assert caught.value.tensor == "w"
    assert torch.equal(tensor, torch.zeros(12, 10)) and tensor.data_ptr() in (param.data_ptr(), big.data_ptr(),
                                                                             held.data_ptr()), "left as it was"


def test_a_target_tensor_the_engine_replaced_fails_the_next_wait_naming_it() -> None:
    """An engine that re-allocates a weight after the sync adopted it (post-load processing, ``.to()``, a new
    ``.data``) reads its own memory from then on: a step landing in the region would leave it stale for good.
    The next wait takes nothing in and raises BindingError naming the tensor; the source's push names the
    target as failed."""
    stores = Stores()
    w = torch.nn.Parameter(global_tensors(0)["w"].clone())
    served = torch.nn.Parameter(torch.zeros(12, 10), requires_grad=False)
    source, target = one_to_one(stores, "r", {"w": Source(w, SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 1))},
                                {"norm_w": Target.whole(served, "w")}, stall_timeout=5)
    try:
        run_ranks([source.push, lambda: target.wait(timeout=20)])
        assert torch.equal(served, w.detach())
        served.data = served.data.clone()       # the engine's own copy, outside the region
        with torch.no_grad():
            w.mul_(2)
        (pushed,), (waited,) = run_ranks([lambda: [_catch(source.push)],
                                          lambda: [_catch(lambda: target.wait(timeout=20))]])
        assert isinstance(waited, tx.BindingError) and waited.tensor == "norm_w", waited
        assert "no longer lives in the sync's region" in str(waited)
        assert list(pushed.failed) == [0] and not pushed.pairs, pushed      # (elastic: the target is named)
        assert not torch.equal(served, w.detach()), "nothing landed in the replaced tensor"
    finally:
        source.close()
        target.close()


def test_targets_that_leave_a_byte_uncovered_are_refused_naming_the_tensor() -> None:
    stores = Stores()
    g = global_tensors(0)
    srcs = {"w": Source(g["w"][:6].clone(), SHAPES["w"], tx.sync.chunk_box(SHAPES["w"], 0, 0, 2))}
    tgts = {"w": Target.whole(torch.zeros(12, 10), "w")}      # wants all rows; only rows 0..5 exist
    with pytest.raises(tx.PlanError, match="'w'"):
        run_ranks([lambda: tx.WeightSync(stores.client(), "u", "source", 0, (1, 1), srcs, timeout=20),
                   lambda: tx.WeightSync(stores.client(), "u", "target", 0, (1, 1), tgts, timeout=20)])


@pytest.mark.parametrize("elastic", [False, True])
def test_a_source_that_goes_away_is_named_or_the_hole_it_leaves_is(elastic: bool) -> None:
    stores = Stores()
    g = global_tensors(0)
    srcs = [source_tensors(r, 2, g) for r in range(2)]
    tgts = [{"w": Target.whole(torch.zeros(12, 10), "w")}]
    for s in srcs:
        for k in list(s):
            if k != "w":
                del s[k]
    syncs = run_ranks([lambda r=r: tx.WeightSync(stores.client(), "v", "source", r, (2, 1), srcs[r], transport="tcp",
                                                 stall_timeout=5, timeout=30, elastic=elastic) for r in range(2)] +
                      [lambda: tx.WeightSync(stores.client(), "v", "target", 0, (2, 1), tgts[0], transport="tcp",
                                             stall_timeout=5, timeout=30, elastic=elastic)])
    try:
        syncs[1].close()                    # source rank 1 goes away before the step
        got: list[Any] = [None]
        t = threading.Thread(target=lambda: got.__setitem__(0, _catch(lambda: syncs[2].wait(timeout=10))))
        t.start()
        if elastic:     # it left the group: the step is planned without it, and rows 6..11 have no source
            with pytest.raises(tx.PlanError, match=r"'w' needs box \[6:12, 0:10\]"):
                syncs[0].push()
            t.join(20)
            assert not t.is_alive()
            assert isinstance(got[0], tx.PlanError) and "[6:12, 0:10]" in str(got[0]), got[0]
        else:           # a fixed group still plans it: its target names it
            syncs[0].push()
            t.join(20)
            assert not t.is_alive()
            assert isinstance(got[0], tx.TransferError) and "source rank 1" in str(got[0]), got[0]
        assert syncs[2].version == 0, "a step with a missing source must not report a version"
    finally:
        for s in syncs:
            s.close()


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as e:
        return e


def test_a_rank_given_twice_is_refused_and_a_fixed_group_takes_no_newcomers() -> None:
    stores = Stores()
    w = torch.randn(4, 4)

    def target(rank: int, **kw: Any) -> Any:
        return tx.WeightSync(stores.client(), "d", "target", rank, (1, 1), {"w": Target.whole(torch.zeros(4, 4), "w")},
                             transport="tcp", **kw)
    source, first = run_ranks([
        lambda: tx.WeightSync(stores.client(), "d", "source", 0, (1, 1), {"w": Source.whole(w)}, transport="tcp",
                              timeout=20, elastic=False),
        lambda: target(0, timeout=20, elastic=False)])
    try:
        with pytest.raises(tx.TransferError, match="target rank 0 is held by another live member"):
            target(0, timeout=1)
        with pytest.raises(tx.TransferError, match="takes no newcomers"):
            target(1, timeout=5, elastic=False)
        _, version = run_ranks([source.push, lambda: first.wait(timeout=20)])
        assert version == 1 and torch.equal(first.region.tensors(framework="torch")["w"], w), "the group went on"
    finally:
        source.close()
        first.close()


def test_a_target_whose_runs_differ_from_its_sources_refuses_the_step() -> None:
    """Each end plans only its own part (plan(..., scope=)), so the offer carries the digest of the pair's
    runs: the same bytes laid out differently (another planner) are refused before any byte moves."""
    from tensorxfer.sync.link import SourceLink, TargetPort
    from tensorxfer.transport.segments import Segments
    from tests.helpers import region_of

    theirs, mine = Segments.of([0, 8], [0, 8], [8, 8]), Segments.of([0, 8], [8, 0], [8, 8])
    assert theirs.total_bytes == mine.total_bytes and theirs.digest != mine.digest
    with region_of(16, fill=7) as src, region_of(16, fill=0) as dst:
        port = TargetPort("127.0.0.1", "t", "g", 0, 5.0, 5.0)
        try:
            port.expect({3})
            admitting = threading.Thread(target=port.admit, args=(5.0,))
            admitting.start()
            link = SourceLink(port.address, "t", "g", 3, 0, "tcp", 1, 5.0, 5.0)
            admitting.join(10)
            got: dict[int, Any] = {}
            deadline = time.monotonic() + 5.0
            receiving = threading.Thread(target=lambda: got.update(port.step(dst, {3: mine}, deadline, "d", 1)))
            receiving.start()
            with pytest.raises(tx.TensorXferError, match="other runs"):
                link.push(src, theirs, 1, "d")
            receiving.join(10)
            assert not receiving.is_alive()
            assert isinstance(got[3], tx.PlanError) and "source 3 computed other runs" in str(got[3]), got
            assert bytes(memoryview(dst.region)[:16]) == bytes(16), "bytes moved despite the refusal"
            link.close()
        finally:
            port.close()


def test_the_offers_go_out_before_the_pack_and_a_failed_pack_ends_the_step_not_the_group(monkeypatch) -> None:
    # A push sends its offers first and packs while the targets take them in; a pack that raises is the
    # push's error, the targets name the source at once (no stall timeout), and the next push works.
    import time

    from tensorxfer.sync import link as link_mod
    from tensorxfer.sync.weight_sync import WeightSync

    stores = Stores()
    g = global_tensors(0)
    srcs = source_tensors(0, 1, g)
    tgts = [target_tensors(r, 2, torch.float32) for r in range(2)]
    events: list[tuple[str, float]] = []
    offers_in = threading.Event()           # both targets hold the first step's offer
    real_recv = link_mod.Channel.recv

    def recv(self: Any, kind: str, *a: Any, **k: Any) -> Any:
        frame = real_recv(self, kind, *a, **k)
        if kind == "offer":
            events.append(("offer", time.monotonic()))
            if sum(what == "offer" for what, _ in events) == 2:
                offers_in.set()
        return frame
    monkeypatch.setattr(link_mod.Channel, "recv", recv)
    real_pack = WeightSync._pack
    fail = [False]

    def pack(self: Any) -> int:
        # the pack waits for the offers: were they sent after it (or by it), this would time out
        assert offers_in.wait(10), "the offers did not go out before the pack"
        if fail[0]:
            raise RuntimeError("the shard's shape changed")
        out = real_pack(self)
        events.append(("packed", time.monotonic()))
        return out
    monkeypatch.setattr(WeightSync, "_pack", pack)
    ranks = run_ranks([
        lambda: tx.WeightSync(stores.client(), "p", "source", 0, (1, 2), srcs, transport="tcp", timeout=20,
                              stall_timeout=30),
        *[lambda r=r: tx.WeightSync(stores.client(), "p", "target", r, (1, 2), tgts[r], transport="tcp",
                                    timeout=20, stall_timeout=30) for r in range(2)]])
    source, targets = ranks[0], ranks[1:]
    try:
        run_ranks([source.push, *[lambda t=t: t.wait(timeout=20) for t in targets]])
        offers = [at for what, at in events if what == "offer"]
        packed = [at for what, at in events if what == "packed"]
        assert len(offers) == 2 and len(packed) == 1 and max(offers) < packed[0], events
        fail[0] = True
        started = time.monotonic()
        results: list[Any] = [None] * 3

        def attempt(i: int, fn: Any) -> None:
            try:
                results[i] = fn()
            except BaseException as e:
                results[i] = e
        threads = [threading.Thread(target=attempt, args=(0, source.push))] + [
            threading.Thread(target=attempt, args=(1 + i, lambda t=t: t.wait(timeout=20)))
            for i, t in enumerate(targets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert isinstance(results[0], RuntimeError) and "shape changed" in str(results[0])
        for r in results[1:]:
            assert isinstance(r, tx.TransferError) and "source rank 0" in str(r), r
        assert time.monotonic() - started < 10, "the targets waited for a stall timeout"
        fail[0] = False
        run_ranks([source.push, *[lambda t=t: t.wait(timeout=20) for t in targets]])
        want = [expected_target(r, 2, g) for r in range(2)]
        for r in range(2):
            for name, x in tgts[r].items():
                assert torch.equal(x.tensor, want[r][name]), name
    finally:
        source.close()
        for t in targets:
            t.close()


@pytest.mark.slow
def test_a_target_waiting_for_a_group_that_never_forms_gives_up_after_its_timeout_not_twice_it() -> None:
    stores = Stores()
    t0 = time.monotonic()
    with pytest.raises(tx.TransferTimeout):
        tx.WeightSync(stores.client(), "alone", "target", 0, (1, 1), {"w": Target.whole(torch.zeros(4), "w")},
                      token="k", transport="tcp", timeout=4)
    assert 3.9 <= time.monotonic() - t0 < 2 * 4 - 0.5     # its timeout, not twice it (a loaded machine's slack)
