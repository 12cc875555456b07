"""Sparse local SGD's functional core (lightning_topk.comm.local): quantizer bounds, packet round trip,
error-feedback conservation, and the outer round on real gloo processes (flat, and 2 nodes x 2 sharded)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_topk.comm.local import (
    VALUE_BITS,
    OuterState,
    PacketLayout,
    chunk_k,
    compress,
    decode_into,
    dequantize,
    mask_positions,
    pack_codes,
    qmax,
    quantize,
    unpack_codes,
    wire_bytes_per_param,
)
from lightning_topk.comm.state import TopKConfig
from tests.helpers.dist import run_distributed


@pytest.mark.parametrize("bits", VALUE_BITS)
def test_quantizer_round_trip_error_is_bounded_per_bit_width(bits):
    g = torch.Generator().manual_seed(bits)
    v = torch.randn(16, 50, generator=g) * torch.logspace(-3, 2, 16).unsqueeze(1)
    codes, scale = quantize(v, bits)
    back = dequantize(codes, scale, bits)
    err = (back - v).abs()
    amax = v.abs().amax(dim=1, keepdim=True)
    if bits == 32:
        assert torch.equal(back, v)
    elif bits == 16:  # bf16: 8 significant bits, round to nearest
        assert bool((err <= v.abs() * 2.0 ** -8).all())
    else:  # half a quantization step per chunk
        assert bool((err <= amax / qmax(bits) / 2 * (1 + 1e-6)).all())
        assert int(codes.abs().max()) <= qmax(bits)
        # and it does not round to zero when there is room: the chunk's largest value is exact up to fp32
        assert torch.allclose(back.abs().amax(dim=1), amax.squeeze(1), rtol=1e-6)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_packed_codes_round_trip(bits):
    q = qmax(bits)
    codes = torch.randint(-q, q + 1, (37,), generator=torch.Generator().manual_seed(1)).to(torch.int8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == -(-37 * bits // 8)
    assert torch.equal(unpack_codes(packed, 37, bits), codes)


@pytest.mark.parametrize("bits", VALUE_BITS)
@pytest.mark.parametrize("density", (0.05, 1.0))
def test_error_feedback_conservation_and_decode(bits, density):
    """sent + new buffer == decay * old buffer + delta (exactly where nothing was sent; within an ulp where
    the sent value was quantized), and the packet decodes to exactly what the sender counts as sent."""
    g = torch.Generator().manual_seed(3)
    C, c = 6, 64
    lay = PacketLayout(C, c, chunk_k(c, density), bits)
    old = torch.randn(C * c, generator=g)
    delta = torch.randn(C * c, generator=g) * 0.1
    acc = old * 0.9 + delta
    e = old.clone().mul_(0.9).add_(delta)
    packet, sent = compress(e, lay)
    assert packet.numel() == lay.nbytes
    total = sent + e
    unsent = sent == 0
    assert torch.equal(total[unsent], acc[unsent])
    assert torch.allclose(total, acc, rtol=0, atol=1e-6 * float(acc.abs().max()))
    if bits == 32:
        assert torch.equal(total, acc)
    nz = int((sent != 0).sum())
    assert nz <= C * lay.k
    out = torch.zeros(C * c)
    assert torch.equal(decode_into(out, packet, lay), sent)


# (c, k): near c/16 (the int16 / bitmap crossover at c = 4096: 256 is a tie, int16 kept), k = 1, k = c - 1,
# c not a multiple of 8, and int32 positions (c > 32768: crossover at c/32)
INDEX_CASES = ((4096, 255), (4096, 256), (4096, 257), (4096, 410), (64, 1), (64, 63), (13, 5), (40000, 1251))


@pytest.mark.parametrize("bits", (32, 16, 4, 2))
@pytest.mark.parametrize("c,k", INDEX_CASES)
def test_bitmap_and_integer_positions_decode_to_the_same_vector(c, k, bits):
    """The same buffer compressed with integer positions and with a bitmap: both packets decode to the same
    dense vector bit for bit, it is what the sender counts as sent, and the error buffers left are identical."""
    C = 3
    g = torch.Generator().manual_seed(c + k + bits)
    e = torch.randn(C * c, generator=g) * torch.logspace(-2, 1, C).repeat_interleave(c)
    e[::7] = 0.0  # ties at zero in every chunk
    got = {}
    for code in ("int", "bitmap"):
        lay = PacketLayout(C, c, k, bits, indices=code)
        assert lay.bitmap == (code == "bitmap")
        buf = e.clone()
        packet, sent = compress(buf, lay)
        assert packet.numel() == lay.nbytes and packet.dtype == torch.uint8
        out = decode_into(torch.zeros(C * c), packet, lay)
        assert torch.equal(out, sent)
        if code == "bitmap":  # exactly k bits set per chunk, none past the chunk's end
            nb = -(-c // 8)
            raw = packet[lay.value_bytes + lay.scale_bytes:][:C * nb].view(C, nb)
            bits_set = ((raw.unsqueeze(2) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(C, nb * 8)
            assert bits_set.sum(dim=1).tolist() == [k] * C
            assert int(bits_set[:, c:].sum()) == 0
        got[code] = (out, buf)
    assert torch.equal(got["int"][0], got["bitmap"][0])
    assert torch.equal(got["int"][1], got["bitmap"][1])
    assert int((got["int"][0] != 0).sum()) <= C * k


@pytest.mark.parametrize("c,k", INDEX_CASES)
def test_mask_positions_fixed_size_and_cpu_paths_agree(c, k):
    # the accelerator path (nonzero_static, no host sync) and the CPU one (nonzero) give the same positions:
    # increasing in each chunk, exactly the set ones
    C = 4
    g = torch.Generator().manual_seed(c * k)
    idx = torch.stack([torch.randperm(c, generator=g)[:k] for _ in range(C)])
    lay = PacketLayout(C, c, k, 4, indices="bitmap")
    mask = torch.zeros(C, c, dtype=torch.bool).scatter_(1, idx, True)
    want = torch.sort(idx, dim=1).values
    for static in (True, False):
        assert torch.equal(mask_positions(mask, lay, static=static), want)


@pytest.mark.parametrize("c", (13, 64, 4096, 32768, 40000))
def test_packet_layout_picks_the_smaller_position_code(c):
    for k in sorted({1, 2, c // 32, c // 32 + 1, c // 16, c // 16 + 1, c // 8, c - 1, c} - {0}):
        auto = PacketLayout(5, c, k, 4)
        forced = [PacketLayout(5, c, k, 4, indices=i) for i in ("int", "bitmap")]
        assert auto.index_bytes == min(f.index_bytes for f in forced)
        if k == c:
            assert auto.index_code == "none" and auto.index_bytes == 0
            continue
        isz = 2 if c <= 32768 else 4
        raw_int, raw_bitmap = k * isz, -(-c // 8)
        assert auto.bitmap == (raw_bitmap < raw_int), (c, k)  # a tie keeps the integers
        assert auto.index_code == ("bitmap" if auto.bitmap else "int16" if isz == 2 else "int32")


def test_registered_presets_packet_bytes():
    # topk_local (10%, 4-bit, chunk 4096): 410 entries -> 208 B of codes + 4 B scale + a 512 B bitmap
    # (was 820 B of int16: 1032 B per chunk); topk_local_wan (2%, 2-bit): 82 entries keep int16 (164 B < 512 B)
    lay = PacketLayout(1, 4096, chunk_k(4096, 0.1), 4)
    assert (lay.index_code, lay.value_bytes, lay.scale_bytes, lay.index_bytes) == ("bitmap", 208, 4, 512)
    assert PacketLayout(1, 4096, 410, 4, indices="int").nbytes == 1032
    assert wire_bytes_per_param(0.1, 4) == 724 / 4096
    wan = PacketLayout(1, 4096, chunk_k(4096, 0.02), 2)
    assert (wan.index_code, wan.value_bytes, wan.scale_bytes, wan.index_bytes) == ("int16", 24, 4, 164)
    assert wire_bytes_per_param(0.02, 2) == wan.nbytes / 4096
    with pytest.raises(ValueError, match="indices must be one of"):
        PacketLayout(1, 64, 4, 4, indices="delta")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _h1_equals_ddp(rank, world):
    """H=1, density 1, fp32, outer_lr 1, momentum 0: the outer round is the average of the replicas, which
    after one inner SGD step is plain DDP's step."""
    torch.manual_seed(10 + rank)
    x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))
    m = _model()
    st = OuterState(TopKConfig(local_steps=1, outer_density=1.0, outer_value_bits=32, outer_lr=1.0, outer_momentum=0.0), list(m.named_parameters()))
    ref = _model()
    opt, ropt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        ran = st.step()
        ropt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        ropt.step()
    return ran, _flat(m), _flat(ref)


def test_h1_dense_fp32_equals_ddp():
    out = run_distributed(_h1_equals_ddp, world=2)
    for ran, got, ref in out:
        assert ran
        assert torch.allclose(got, ref, atol=1e-6)
    assert torch.equal(out[0][1], out[1][1])  # replicas agree bit for bit


def _sharded(rank, world, streaming, exchange="allgather", stop_at=4):
    """2 nodes x 2: the node's ranks hold the same replica; shards over the inter groups; then resume from a
    state dict taken inside a round equals the uninterrupted run."""
    from lightning_topk.comm.exchanges.hierarchical import make_groups

    h = make_groups(2, 2, rank)
    opts = TopKConfig(local_steps=3, outer_density=0.1, outer_chunk=128, outer_value_bits=4, outer_lr=0.7,
                      outer_momentum=0.9, outer_nesterov=True, outer_ef_decay=0.95, outer_streaming=streaming,
                      outer_exchange=exchange)
    torch.manual_seed(20 + h.node_rank)  # data per node (a node is one replica)
    data = [(torch.randn(16, 20), torch.randint(0, 5, (16,))) for _ in range(8)]

    def run(stop=None, sd=None):
        m = _model()
        st = OuterState(opts, list(m.named_parameters()), inter=h.inter, intra=h.intra, local=2,
                        local_rank=h.local_rank)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        start = 0
        if sd is not None:
            st.load_state_dict(sd)
            start = stop_at
        for x, y in data[start:stop]:
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            st.step()
        st.finish_flight()
        return m, st

    full, st_full = run()
    _, st_half = run(stop=stop_at)
    sd = st_half.state_dict()
    resumed, _ = run(sd=sd)
    if exchange == "scatter":
        from lightning_topk.comm.local import round_bytes_out

        assert st_full.exchange == "scatter" and float(st_half.owner_ef.abs().sum()) > 0
        return (_flat(full), _flat(resumed), st_full.stats.bytes, round_bytes_out(st_full.layout, 2, "scatter"),
                sd["position"], sd["owner"], st_full.layout.C)
    return _flat(full), _flat(resumed), st_full.stats.bytes, st_full.layout.nbytes, sd["position"]


@pytest.mark.parametrize("streaming", (False, True))
def test_two_nodes_sharded_rounds_agree_and_resume_inside_a_round(streaming):
    out = run_distributed(_sharded, world=4, args=(streaming,))
    for full, resumed, nbytes, packet, pos in out:
        assert pos == 1  # the save was inside the second round
        assert torch.equal(full, resumed)
        assert nbytes == packet  # one other replica: (R - 1) packets
    # every rank ends on the same θ (θ_local := θ_outer after the last round, and 8 % 3 == 2 steps since)
    # the node's two ranks hold the same replica bit for bit
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[2][0], out[3][0])


@pytest.mark.parametrize("stop_at", (4, 6))
def test_two_nodes_sharded_scale_free_rounds_agree_and_resume_inside_and_at_the_end_of_a_round(stop_at):
    # 2 nodes x 2 processes, outer_exchange="scatter" pinned (auto keeps the all-gather at 2 replicas): each local
    # rank runs the scale-free exchange among its inter group (its shard's chunks split between the two owners).
    # Saved 1 step into the second round (stop 4) and at the end of the second round (stop 6); both resume bit
    # for bit, the owners' buffers included.
    out = run_distributed(_sharded, world=4, args=(False, "scatter", stop_at))
    for full, resumed, nbytes, expect, pos, _, _ in out:
        assert pos == stop_at % 3
        assert torch.equal(full, resumed)
        assert nbytes == expect > 0
    assert [o[5][1] for o in out] == [0, 0, 1, 1]  # ranks 0, 1 on node 0: owner 0 in their inter groups
    assert all(o[5][0] == 2 and o[5][2] == -(-o[6] // 2) for o in out)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[2][0], out[3][0])  # a node's ranks: one replica


def _fault(rank, world, mode):
    """A non-finite pseudo-gradient on rank 1 only: decided once on every rank."""
    m = _model()
    st = OuterState(TopKConfig(local_steps=2, outer_density=0.5, outer_value_bits=8, nonfinite=mode), list(m.named_parameters()))
    theta0 = _flat(m).clone()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * (rank + 1))
    assert not st.step()
    if rank == 1:
        with torch.no_grad():
            next(m.parameters()).view(-1)[3] = float("nan")
    try:
        st.step()
    except FloatingPointError as e:
        return "raised", str(e)
    return "skipped", st.stats.skipped, torch.equal(_flat(m), theta0), float(st.ef.abs().sum()), st.position


@pytest.mark.parametrize("mode", ("skip", "raise"))
def test_nonfinite_pseudo_gradient_decided_on_every_rank(mode):
    out = run_distributed(_fault, world=2, args=(mode,))
    if mode == "raise":
        assert all(o[0] == "raised" and "nonfinite='skip'" in o[1] for o in out)
    else:  # the round is skipped everywhere: θ_local := θ_outer, the error buffer untouched
        assert all(o == ("skipped", 1, True, 0.0, 0) for o in out), out



TABLE = torch.linspace(0.01, 1.0, 64)  # a constant float buffer no rank changes


def _bn_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
    m.register_buffer("table", TABLE.clone())
    return m


def _buffers(rank, world):
    """3 ranks with a BatchNorm1d, H=2, nonfinite='skip': at the round end the float buffers are the anchor
    plus the mean of the changes; a non-finite running statistic on one rank skips the next round on every
    rank and puts the buffers back to the round's start."""
    m = _bn_model()
    st = OuterState(TopKConfig(local_steps=2, outer_density=0.5, outer_value_bits=8, nonfinite="skip"),
                    list(m.named_parameters()), buffers=list(m.named_buffers()))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.manual_seed(30 + rank)
    data = [(torch.randn(8, 20) * (1 + rank), torch.randint(0, 5, (8,))) for _ in range(4)]
    rounds = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        if i == 3 and rank == 2:
            with torch.no_grad():
                m[1].running_var[0] = float("inf")
        before = st.bufs.flat().clone()
        if st.step():
            rounds.append((before, st.bufs.flat().clone()))
    return (rounds, torch.equal(m.table, TABLE), st.stats.skipped, st.stats.buffer_bytes,
            sorted(st.state_dict()["buffers"]), int(m[1].num_batches_tracked))


def test_buffers_averaged_over_every_rank_and_restored_on_a_skipped_round():
    assert not torch.equal((TABLE + TABLE + TABLE) / 3, TABLE)  # a plain mean would move the constant buffer
    out = run_distributed(_buffers, world=3)
    befores = [o[0][0][0] for o in out]  # each rank's buffers just before the first round
    assert not torch.equal(befores[0], befores[1])
    for rounds, table_exact, skipped, nbytes, names, tracked in out:
        assert len(rounds) == 2 and skipped == 1
        assert table_exact  # only the changes are averaged: an unchanged buffer stays bit for bit
        # round 1: the average of the three ranks' statistics, identical on every rank
        assert torch.equal(rounds[0][1], out[0][0][0][1])
        assert torch.allclose(rounds[0][1], sum(befores) / 3, rtol=0, atol=1e-6)
        # round 2 skipped (rank 2's running_var is inf): back to the start of the round, on every rank
        assert torch.equal(rounds[1][1], rounds[0][1])
        # 16 mean + 16 var + 64 table fp32 in a ring all-reduce over 3 ranks
        assert nbytes == 2 * 2 * 4 * 96 // 3
        assert names == ["1.num_batches_tracked", "1.running_mean", "1.running_var", "table"]
        assert tracked == 4  # integer buffers are left alone


def _drain_then_release(rank, world):
    """2 nodes x 2, streaming: the round of the last step is in flight when training ends. The state waits for
    it (its result kept as pending, as before a checkpoint), then the groups make_groups made are destroyed."""
    from lightning_topk.comm.exchanges import Layout
    from lightning_topk.comm.exchanges.hierarchical import destroy_groups, make_groups
    from lightning_topk.comm.state import TopKState

    h = make_groups(2, 2, rank)
    cfg = TopKConfig(local_steps=2, outer_density=0.5, outer_value_bits=8, outer_momentum=0.0, outer_streaming=True)
    state = TopKState(cfg, hier=h, num_nodes=2)
    state.exchange = ex = state.exchange_for("local", layout=Layout(2, 2, rank))
    m = _model()
    ex.bind(m.named_parameters())
    for step in range(4):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * (h.node_rank + 1) * (step + 1))
        ex.after_optimizer_step(m.named_parameters())
    launched = state.in_flight
    state.finish_in_flight()
    groups = len(dist.distributed_c10d._world.pg_map)
    destroy_groups(h)
    destroy_groups(h)  # a second teardown: nothing left to destroy
    return launched, state.in_flight, ex.outer.pending is not None, groups, len(dist.distributed_c10d._world.pg_map)


def test_finish_in_flight_waits_for_the_streamed_round_and_destroy_groups_releases_them():
    for launched, after, pending, groups, left in run_distributed(_drain_then_release, world=4):
        assert launched and not after and pending
        assert (groups, left) == (3, 1)  # the world, this rank's intra- and inter-node groups; then the world


# ---- the scale-free outer exchange (outer_exchange="scatter") ------------------------------------------
def _scatter_cfg(**kw):
    base = dict(local_steps=2, outer_density=0.1, outer_chunk=96, outer_value_bits=4, outer_lr=1.0,
                outer_momentum=0.0, outer_exchange="scatter")
    base.update(kw)
    return TopKConfig(**base)


def _drift(m, rank, step):
    """A deterministic per-rank change of the weights (an inner step's stand-in)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


def _scatter_vs_allgather(rank, world):
    """Density 1, fp32: the owners' re-selection sends everything, so the scale-free round is the all-gather's
    average, bit for bit (the same summation order per entry)."""
    out = {}
    for ex in ("allgather", "scatter"):
        m = _model()
        st = OuterState(_scatter_cfg(outer_density=1.0, outer_value_bits=32, outer_exchange=ex, outer_momentum=0.9),
                        list(m.named_parameters()))
        for s in range(6):
            _drift(m, rank, s)
            st.step()
        out[ex] = (_flat(m), st.exchange, float(st.owner_ef.abs().sum()) if ex == "scatter" else 0.0)
    return out


def test_scatter_at_density_one_fp32_is_the_allgather_average_bit_for_bit():
    out = run_distributed(_scatter_vs_allgather, world=4)
    for o in out:
        assert o["allgather"][1] == "allgather" and o["scatter"][1] == "scatter"
        assert torch.equal(o["scatter"][0], o["allgather"][0])
        assert o["scatter"][2] == 0.0  # nothing left at the owners
    assert all(torch.equal(o["scatter"][0], out[0]["scatter"][0]) for o in out)


def _scatter_conservation(rank, world, bits=4):
    """One round at density 0.1, ``bits`` bits, outer lr 1, momentum 0 (the update is g itself): the replicas' mean
    error feedback, the owners' buffers and the applied update add up to the mean pseudo-gradient."""
    m = _model()
    st = OuterState(_scatter_cfg(local_steps=1, outer_value_bits=bits), list(m.named_parameters()))
    theta0 = st.theta.clone()
    _drift(m, rank, 0)
    delta = theta0 - st.view.flat_params()
    assert st.step()
    g = theta0 - st.theta
    lo, hi = st.outer_exchange.owner_range(st.shard)
    owned = torch.zeros_like(st.ef)
    owned[lo:hi] = st.owner_ef[:hi - lo]
    parts = torch.stack([delta, st.ef, owned])
    everyone = [torch.empty_like(parts) for _ in range(world)]
    dist.all_gather(everyone, parts)
    d, e, o = (torch.stack([t[i] for t in everyone]) for i in range(3))
    packet = st.layout.nbytes
    seg = st.outer_exchange.owner_layout.nbytes + st.outer_exchange.owner_out_layout.nbytes
    picks = [OuterState(_scatter_cfg(outer_exchange="auto", outer_chunk=ch), list(_model().named_parameters())).exchange
             for ch in (96, 0)]
    return (g, d.mean(0), e.mean(0), o.sum(0), st.stats.bytes, seg, packet, _flat(m), picks,
            (st.outer_exchange.owner_layout.bits, st.outer_exchange.owner_out_layout.bits))


@pytest.mark.parametrize("bits", (4, 2))
def test_scatter_conserves_the_pseudo_gradient_and_replicas_agree(bits):
    # 2 bits: the replicas send ternary codes, the owners re-quantize at OWNER_MIN_BITS (4)
    out = run_distributed(_scatter_conservation, world=4, args=(bits,))
    assert all(o[9] == (bits, 4) for o in out)
    g, dmean, emean, osum, nbytes, seg, packet, theta, _, _ = out[0]
    assert float(g.abs().sum()) > 0 and float(osum.abs().sum()) > 0  # sent something, kept something at owners
    assert torch.allclose(g + emean + osum, dmean, atol=1e-6)
    assert nbytes == 3 * seg  # all-to-all (R - 1 segments) + ring all-gather (R - 1 owner segments)
    assert nbytes < 3 * packet  # the all-gather's (R - 1) packets
    assert all(torch.equal(o[7], theta) for o in out)  # θ_local := the same θ_outer on every replica
    assert all(o[8][1] == "allgather" for o in out)  # auto at 4 replicas: one chunk per shard -> allgather


def _scatter_resume(rank, world):
    """Resume from a state dict taken inside a round equals the uninterrupted run; a world-size change
    (reshard) keeps the pending update, owner buffers included; a skipped round leaves the owner buffer."""
    from lightning_topk.comm.local import reshard

    def run(stop=7, sd=None, start=0, **kw):
        m = _model()
        st = OuterState(_scatter_cfg(local_steps=3, outer_momentum=0.9, outer_nesterov=True, outer_lr=0.7, **kw),
                        list(m.named_parameters()))
        if sd is not None:
            st.load_state_dict(sd)
        for s in range(start, stop):
            _drift(m, rank, s)
            st.step()
        return m, st

    full, _ = run()
    _, half = run(stop=4)
    sd = half.state_dict()
    resumed, _ = run(sd=sd, start=4)
    sections = [None] * world
    dist.all_gather_object(sections, sd)
    new = reshard(sections, 1, rank % 2)
    # a plain all-gather run cannot take the owner buffer as is
    m = _model()
    other = OuterState(_scatter_cfg(local_steps=3, outer_exchange="allgather"), list(m.named_parameters()))
    try:
        other.load_state_dict(sd)
        refused = ""
    except ValueError as e:
        refused = str(e)
    # a skipped round: NaN on rank 3 at the round end
    m = _model()
    st = OuterState(_scatter_cfg(local_steps=2, nonfinite="skip"), list(m.named_parameters()))
    for s in range(2):
        _drift(m, rank, s)
        st.step()
    before = st.owner_ef.clone()
    _drift(m, rank, 2)
    st.step()
    if rank == 3:
        with torch.no_grad():
            next(m.parameters()).view(-1)[0] = float("nan")
    _drift(m, rank, 3)
    st.step()
    return (_flat(full), _flat(resumed), sd, new, refused, torch.equal(before, st.owner_ef),
            float(before.abs().sum()), st.stats.skipped)


def test_scatter_resumes_bit_exactly_reshards_its_owner_buffers_and_survives_a_skip():
    out = run_distributed(_scatter_resume, world=4)
    sds = [o[2] for o in out]
    assert all(sd["position"] == 1 and "owner_ef" in sd for sd in sds)  # saved inside the second round
    for full, resumed, _, _, refused, same, owned, skipped in out:
        assert torch.equal(full, resumed)
        assert "outer_exchange='scatter'" in refused and "'allgather'" in refused
        assert same and owned > 0 and skipped == 1
    # reshard to 2 replicas: every new replica's ef = the saved replicas' mean ef + the sum of owner buffers
    names = list(sds[0]["ef"])
    for n in names:
        mean_ef = sum(sd["ef"][n].double() for sd in sds) / 4
        owners = sum(sd["owner_ef"][n].double() for sd in sds)
        assert float(owners.abs().sum()) > 0 or n.endswith("bias")
        for o in out:
            assert "owner_ef" not in o[3]
            assert torch.allclose(o[3]["ef"][n].double(), mean_ef + owners, atol=1e-6)


def test_outer_exchange_option_and_auto_rule():
    from lightning_topk.comm.local import SCATTER_MAX_BYTE_SHARE, outer_exchange_for, round_bytes_out

    with pytest.raises(ValueError, match="outer_exchange must be one of"):
        TopKConfig(local_steps=4, outer_exchange="ring")
    with pytest.raises(ValueError, match="outer_exchange='scatter' does not stream"):
        TopKConfig(local_steps=4, outer_exchange="scatter", outer_streaming=True)
    C, c = 2766, 4096  # the cluster model's 11.3M parameters, one process per node
    local = PacketLayout(C, c, chunk_k(c, 0.1), 4)   # topk_local: 10% at 4 bits (bitmap positions)
    wan = PacketLayout(C, c, chunk_k(c, 0.02), 2)    # topk_local_wan: 2% at 2 bits (int16 positions)
    auto = TopKConfig(local_steps=4)
    assert auto.outer_exchange == "auto"
    # auto: the scale-free exchange where it sends at most SCATTER_MAX_BYTE_SHARE of the all-gather's bytes
    assert [outer_exchange_for(auto, r, local) for r in (1, 2, 3, 4, 16)] == \
        ["allgather", "allgather", "allgather", "scatter", "scatter"]
    wan4 = PacketLayout(C, c, chunk_k(c, 0.02), 4)
    assert [outer_exchange_for(auto, r, wan4) for r in (2, 4, 8)] == ["allgather", "allgather", "scatter"]
    # 2-bit values: auto keeps the all-gather (the owners' re-quantization lost accuracy on the cluster); pinned,
    # the owners quantize at OWNER_MIN_BITS
    wan_cfg = TopKConfig(local_steps=64, outer_density=0.02, outer_value_bits=2)
    assert [outer_exchange_for(wan_cfg, r, wan) for r in (4, 8, 64)] == ["allgather"] * 3
    wan_pinned = TopKConfig(local_steps=64, outer_density=0.02, outer_value_bits=2, outer_exchange="scatter")
    assert outer_exchange_for(wan_pinned, 8, wan) == "scatter"
    assert round_bytes_out(local, 4, "scatter") <= SCATTER_MAX_BYTE_SHARE * round_bytes_out(local, 4, "allgather")
    assert round_bytes_out(wan4, 4, "scatter") > SCATTER_MAX_BYTE_SHARE * round_bytes_out(wan4, 4, "allgather")
    streamed = TopKConfig(local_steps=4, outer_streaming=True, outer_momentum=0.0)
    assert outer_exchange_for(streamed, 16, local) == "allgather"
    pinned = TopKConfig(local_steps=4, outer_exchange="scatter")
    assert outer_exchange_for(pinned, 2, wan) == "scatter" and outer_exchange_for(pinned, 1, wan) == "allgather"
    # auto also needs the shard to split among the owners: not with one chunk per shard (outer_chunk=0: one owner
    # would take it all, 2.3x the all-gather's bytes), nor where it sends as many or more
    one_chunk = PacketLayout(1, 11_326_410, chunk_k(11_326_410, 0.1), 4)
    tie = PacketLayout(3, 4096, chunk_k(4096, 0.02), 2)  # topk_local_wan's digits MLP (9,610 parameters)
    assert round_bytes_out(one_chunk, 4, "scatter") > 2 * round_bytes_out(one_chunk, 4, "allgather")
    assert round_bytes_out(tie, 4, "scatter") >= round_bytes_out(tie, 4, "allgather")
    assert [outer_exchange_for(auto, r, one_chunk) for r in (4, 32)] == ["allgather", "allgather"]
    assert outer_exchange_for(pinned, 4, one_chunk) == "scatter"  # pinned: as asked
    assert round_bytes_out(local, 1, "scatter") == 0 and round_bytes_out(local, 5, "allgather") == 4 * local.nbytes


def test_scatter_bytes_per_replica_stay_flat_in_the_replica_count():
    """Pure arithmetic at the topk_local_wan preset: (R - 1) packets for the all-gather; for the scale-free
    exchange (R - 1) segments of ceil(C / R) chunks and (R - 1) owner segments at twice the density and at 4 bits
    (the preset's 2 are raised to OWNER_MIN_BITS); outer.round_bytes_out (what OuterStats.bytes counts) agrees."""
    from lightning_topk.comm.local import OWNER_K_FACTOR, OWNER_MIN_BITS, owner_chunks, round_bytes_out

    n, c = 11_326_410, 4096
    C = -(-n // c)
    k = chunk_k(c, 0.02)
    lay = PacketLayout(C, c, k, 2)
    rows = []
    for R in (2, 4, 8, 16, 32):
        per = owner_chunks(C, R)
        seg = PacketLayout(per, c, k, 2).nbytes + PacketLayout(per, c, min(c, OWNER_K_FACTOR * k), OWNER_MIN_BITS).nbytes
        rows.append(((R - 1) * lay.nbytes, (R - 1) * seg))
        assert round_bytes_out(lay, R, "allgather") == rows[-1][0] and round_bytes_out(lay, R, "scatter") == rows[-1][1]
    ag, sc = zip(*rows)
    assert OWNER_MIN_BITS == 4
    assert sc[-1] < 3.2 * lay.nbytes and ag[-1] == 31 * lay.nbytes  # flat in R: about 3.1 packets
    assert sc[1] <= 1.001 * 0.8 * ag[1]  # 0.8x at R = 4 (the last owner's padded chunks aside)
    assert sc[3] < 0.2 * ag[3]  # R = 16
    assert sc[0] > ag[0]  # at R = 2 it would send more: auto keeps the all-gather there
