"""The top-k comm hook on real gloo processes, without a Trainer."""
import math

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_topk import TopKConfig, TopKState, topk_allgather_hook
from lightning_topk.comm.controller import Decision, StepController
from lightning_topk.comm.exchanges import kit
from lightning_topk.comm.exchanges.kit import rebuild
from lightning_topk.comm.wire import IndexCode, index_code, index_dtype_for, pack, packed_nbytes, unpack
from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def _batches(rank, steps, same_data=False):
    g = torch.Generator().manual_seed(0 if same_data else 100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(steps)]


def _train(rank, world, cfg, steps=6, same_data=False, hook=True, record=False, bucket_cap_mb=0.05):
    m = _model()
    ddp = DDP(m, bucket_cap_mb=bucket_cap_mb)
    state = None
    if hook:
        state = TopKState(TopKConfig(**cfg))
        state.bind(m.named_parameters())
        state.debug.enabled = record
        ddp.register_comm_hook(state, topk_allgather_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    history = []
    for x, y in _batches(rank, steps, same_data):
        old = {k: v.clone() for k, v in state.residuals().items()} if record else None
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if record:
            history.append((old, {k: v.clone() for k, v in state.residuals().items()},
                            {k: v.clone() for k, v in state.debug.sent.items()},
                            {k: v.clone() for k, v in state.debug.grads_in.items()},
                            {n: p.grad.clone() for n, p in m.named_parameters()}))
        opt.step()
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return params, history, (state.totals if state else None)


def _all_scenarios(rank, world):
    return {
        "dense": _dense_vs_topk(rank, world),
        "fp32": _conservation(rank, world, "fp32", False),
        "bf16": _conservation(rank, world, "bf16", False),
        "identical": _identical(rank, world),
        "mc": _mc(rank, world),
        "nonfinite": _nonfinite(rank, world),
        "param": _train(rank, world, dict(density=0.02, min_sparse_numel=100, selection_scope="parameter"),
                        steps=4, record=True),
    }


@pytest.fixture(scope="module")
def runs():
    res = run_distributed(_all_scenarios, 2)
    return {key: [r[key] for r in res] for key in res[0]}


def _dense_vs_topk(rank, world):
    ref, _, _ = _train(rank, world, None, hook=False)
    got, _, totals = _train(rank, world, dict(density=1.0))
    return ref, got, totals


def test_density_one_equals_plain_ddp(runs):
    for ref, got, totals in runs["dense"]:
        assert totals.buckets_via("dense", "dense_bf16") == totals.buckets > 0
        for k in ref:
            assert torch.allclose(ref[k], got[k], atol=1e-6, rtol=0), k


def _conservation(rank, world, value_dtype, mc):
    cfg = dict(density=0.02, min_sparse_numel=0, dense_steps=1, value_dtype=value_dtype, momentum_correction=mc)
    return _train(rank, world, cfg, steps=5, record=True)


@pytest.mark.parametrize("value_dtype", ["fp32", "bf16"])
def test_conservation_sent_plus_residual_equals_old_residual_plus_grad(runs, value_dtype):
    results = runs[value_dtype]
    for _params, history, totals in results:
        assert totals.numel_sent < totals.numel  # sparse steps happened
        for step, (old, new, sent, grad, _) in enumerate(history):
            for name, g in grad.items():
                o = old.get(name, torch.zeros_like(g))
                lhs = sent[name] + new.get(name, torch.zeros_like(g))
                assert torch.allclose(lhs, o + g, atol=1e-6, rtol=1e-5), (step, name)
    # different data on the two ranks -> different residuals (they are per-rank state)
    r0, r1 = results[0][1][-1][1], results[1][1][-1][1]
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)



def _identical(rank, world):
    cfg = dict(density=0.05, min_sparse_numel=0, dense_steps=0)
    return _train(rank, world, cfg, steps=2, same_data=True, record=True)


def test_duplicates_across_ranks_add_not_overwrite(runs):
    # Same data on both ranks: both pick the same entries; the average must equal what one rank sent
    # (a scatter_-based rebuild would give half of it).
    for _, history, _ in runs["identical"]:
        for _old, _new, sent, _grad, after in history:
            for name, s in sent.items():
                assert torch.allclose(after[name].reshape(-1), s, atol=1e-6), name
                assert s.count_nonzero() > 0


def _mc(rank, world):
    return _train(rank, world, dict(density=0.02, min_sparse_numel=0, momentum_correction=True), steps=5, record=True)


def test_momentum_correction_keeps_finite_state_and_sends_k(runs):
    for params, history, _totals in runs["mc"]:
        assert all(torch.isfinite(v).all() for v in params.values())
        old, new, sent, grad, _ = history[-1]
        n = sum(v.numel() for v in sent.values())
        nz = sum(int(v.count_nonzero()) for v in sent.values())
        assert nz <= math.ceil(0.02 * n) + 10


def test_rebuild_index_add_and_codec_roundtrip():
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    idx = torch.tensor([5, 7, 5, 0])
    out = rebuild(torch.full((10,), 7.0), vals, idx)
    assert out[5] == 4.0 and out[7] == 2.0 and out[0] == 4.0 and out.sum() == 10.0
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        v = torch.randn(6).to(dt)
        i = torch.tensor([0, 9, 3, 2**31 - 1, 4, 1], dtype=torch.int32)
        buf = torch.cat([pack(v, i), pack(v * 2, i)])
        v2, i2 = unpack(buf, 6, dt, 2)
        assert torch.equal(v2[:6], v.float()) and torch.equal(v2[6:], (v * 2).float())
        assert torch.equal(i2[:6], i) and i2.dtype == torch.int32


def _nonfinite(rank, world):
    m = _model()
    ddp = DDP(m, bucket_cap_mb=0.05)
    st = TopKState(TopKConfig(density=0.05, min_sparse_numel=0, dense_steps=0, nonfinite="skip"))
    st.bind(m.named_parameters())
    ddp.register_comm_hook(st, topk_allgather_hook)
    ctl = StepController(st)
    x, y = _batches(rank, 1)[0]
    nn.functional.cross_entropy(ddp(x), y).backward()
    first = ctl.finish_step()
    before = {k: v.clone() for k, v in st.residuals().items()}
    for p in m.parameters():
        p.grad = None
    loss = nn.functional.cross_entropy(ddp(x), y)
    if rank == 1:
        loss = loss * float("inf")
    loss.backward()
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    second = ctl.finish_step()
    after = {k: v.clone() for k, v in st.residuals().items()}
    return before, after, grads_finite, (first, second, st.step)


def test_nonfinite_on_one_rank_reaches_all_ranks_and_residuals_roll_back(runs):
    for before, after, grads_finite, (first, second, step) in runs["nonfinite"]:
        assert not grads_finite  # every rank sees the overflow in the exchanged result
        assert (first, second, step) == (Decision.COMMIT, Decision.SKIP, 1)  # the skipped exchange is undone
        assert before.keys() == after.keys() and before
        for k in before:
            assert torch.equal(before[k], after[k]), k


def test_wire_indices_widen_for_huge_buckets():
    assert index_dtype_for(2**31) == torch.int32 and index_dtype_for(2**31 + 1) == torch.int64
    i = torch.tensor([0, 2**31 + 5, 2**33], dtype=torch.int64)
    v = torch.ones(3, dtype=torch.float16)
    wide = IndexCode("int64", out=torch.int64)
    v2, i2 = unpack(pack(v, i, wide), 3, torch.float16, 1, wide)
    assert torch.equal(i2, i) and torch.equal(v2, v.float())
    assert packed_nbytes(3, torch.float16, wide) == 3 * (2 + 8)
    assert index_code(2**33, 3) == IndexCode("int64", out=torch.int64)  # 3 entries: block counts cost more
    assert index_code(2**33, 10**6).out == torch.int64  # blocks, returned as int64


@pytest.mark.parametrize("n,k", [(6_400_000, 64_000), (6_400_000, 6_400), (70_000, 3_000), (2**16, 5_000),
                                 (3 * 2**16 + 7, 40_000)])
def test_block_index_code_roundtrips_every_rank_and_halves_index_bytes(n, k):
    code = index_code(n, k)
    assert code.kind == "blocks" and code.blocks == -(-n // 2**16)
    assert code.nbytes(k) == 2 * k + 4 * code.blocks < 4 * k
    g = torch.Generator().manual_seed(n + k)
    ranks = []
    for r in range(3):
        idx = torch.randperm(n, generator=g)[:k]
        if r == 1:  # block edges and the last entry
            edges = torch.tensor(sorted({0, 2**16 - 1, min(2**16, n - 1), n - 1}))
            rest = idx[~torch.isin(idx, edges)][:k - edges.numel()]
            idx = torch.cat([rest, edges])[torch.randperm(k, generator=g)]
        ranks.append((torch.randn(k, generator=g).to(torch.bfloat16), idx))
    buf = torch.cat([pack(v, i, code) for v, i in ranks])
    assert buf.numel() == 3 * packed_nbytes(k, torch.bfloat16, code)
    for v, i in ranks:  # host_reads skips the sort of ascending indices only; the bytes are the same
        order = i.argsort()
        assert torch.equal(pack(v, i, code, host_reads=True), pack(v, i, code))
        assert torch.equal(pack(v[order], i[order], code, host_reads=True), pack(v, i, code))
    vals, idx = unpack(buf, k, torch.bfloat16, 3, code)
    assert idx.dtype == torch.int32
    for r, (v, i) in enumerate(ranks):  # the same pairs; sorted by index inside a rank's packet
        got_i, got_v = idx[r * k:(r + 1) * k], vals[r * k:(r + 1) * k]
        order = i.argsort()
        assert torch.equal(got_i.long(), i[order]) and torch.equal(got_v, v[order].float())
    # the rebuilt dense sum is what int32 indices give, bit for bit (index_add_ sums each index in rank order)
    ref = torch.cat([pack(v, i) for v, i in ranks])
    rv, ri = unpack(ref, k, torch.bfloat16, 3)
    assert torch.equal(rebuild(torch.zeros(n), vals, idx), rebuild(torch.zeros(n), rv, ri))


def test_the_result_check_over_the_touched_entries_sees_a_nonfinite_value_and_an_overflowing_sum():
    st = TopKState(TopKConfig(density=0.01))
    big = torch.finfo(torch.float32).max
    for values, bad in (([1.0, 2.0], False), ([float("nan"), 1.0], True), ([big, big], True)):
        grad = torch.zeros(100)
        kit.deliver_sum(st, grad, kit.zeroed_result(grad), torch.tensor(values), torch.tensor([7, 7]))
        assert bool(st.flags.result) == bad
        st.flags.clear()


def test_small_k_keeps_int32_indices():
    assert index_code(6_400_000, 100) == IndexCode("int32")  # 98 block counts would cost more than they save


def test_parameter_scope_sends_k_per_parameter_and_conserves(runs):
    for _params, history, _totals in runs["param"]:
        for old, new, sent, grad, _ in history[1:]:  # step 0 is dense
            for name, g in grad.items():
                n = g.numel()
                k = n if n < 100 else math.ceil(0.02 * n)
                assert int(sent[name].count_nonzero()) <= k, name
                o = old.get(name, torch.zeros_like(g))
                assert torch.allclose(sent[name] + new[name], o + g, atol=1e-6, rtol=1e-5), name


def _peer_never_comes(rank, world):
    """Rank 0 never joins rank 1's exchange: rank 1's hook must fail with the collective's own timeout. Its
    callback used to read the output buffer regardless (torch.empty on an error: IndexError or, worse,
    garbage gradients)."""
    import datetime

    import torch.distributed as dist

    from lightning_topk.comm.exchanges.dense import dense_topk_hook

    errors = {}
    for name, hook, cfg in (("allgather", topk_allgather_hook, dict(density=0.05, min_sparse_numel=0)),
                            ("dense", dense_topk_hook, dict(density=1.0))):
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
        m = _model()
        ddp = DDP(m, process_group=group, bucket_cap_mb=0.05)
        st = TopKState(TopKConfig(**cfg), process_group=group)
        st.bind(m.named_parameters())
        ddp.register_comm_hook(st, hook)
        if rank == 1:
            x, y = _batches(rank, 1)[0]
            try:
                nn.functional.cross_entropy(ddp(x), y).backward()
                errors[name] = None
            except Exception as e:
                errors[name] = str(e)
        dist.barrier()  # the default group still works
    return errors


def test_a_failed_collective_raises_its_own_error_not_a_garbage_result():
    errors = run_distributed(_peer_never_comes, 2)[1]
    for name, msg in errors.items():
        assert msg is not None, name
        assert "index out of range" not in msg and "timed out" in msg.lower(), (name, msg[-500:])
