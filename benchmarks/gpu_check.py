"""The Python steps of ``benchmarks/gpu_check.sh`` (one step per process, so a CUDA error in one leaves the
others alone). Each prints what it checked and exits non-zero on a failed check.

    python benchmarks/gpu_check.py probe     # exit 0 with a CUDA device, 3 without (prints why)
    python benchmarks/gpu_check.py syncs     # set_sync_debug_mode("error") inside the exchange hooks
    python benchmarks/gpu_check.py kernels   # CUDA kernels (CuPy) against their torch references
    python benchmarks/gpu_check.py nccl1     # a world-size-1 NCCL Trainer run with TopKDDPStrategy
    python benchmarks/gpu_check.py gloo2     # 2 (and 4) processes on one GPU, gloo on CUDA tensors
    python benchmarks/gpu_check.py fsdp      # topk_fsdp on CUDA: 2x2 over gloo vs HSDP, memory, NCCL world size 1

Only public names are used: ``lightning_topk``'s exports, ``lightning_topk.comm.make_groups`` and
``lightning_topk.ops.cuda``; the hooks the strategy picks are found by wrapping
``DistributedDataParallel.register_comm_hook``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import threading
import traceback
from typing import Any, Callable, Dict, Iterator, List

NO_DEVICE = 3  # exit status of `probe` without a usable CUDA device


# ------------------------------------------------------------------------------------ strict hooks
class StrictHooks:
    """Runs DDP comm hooks, and the callbacks they chain with ``Future.then``, under
    ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation inside raises. The mode is
    process-wide, so it is switched on for the duration of each hook or callback only."""

    def __init__(self) -> None:
        self.calls = 0
        self._tls = threading.local()
        self._then: Any = None

    def run(self, fn: Callable, *args: Any) -> Any:
        import torch

        if getattr(self._tls, "on", False):
            return fn(*args)
        self._tls.on = True
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            self._tls.on = False

    def wrap(self, hook: Callable) -> Callable:
        @functools.wraps(hook)  # DDP checks the hook's annotations
        def strict_hook(state: Any, bucket: Any) -> Any:
            self.calls += 1
            return self.run(hook, state, bucket)

        return strict_hook

    @contextlib.contextmanager
    def installed(self) -> Iterator["StrictHooks"]:
        """Every ``register_comm_hook`` in the block registers the strict version of its hook."""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        register, then = DDP.register_comm_hook, torch._C.Future.then
        strict = self

        def register_strict(ddp: Any, state: Any, hook: Callable) -> Any:
            return register(ddp, state, strict.wrap(hook))

        def then_strict(fut: Any, callback: Callable) -> Any:
            if getattr(strict._tls, "on", False):
                return then(fut, lambda f: strict.run(callback, f))
            return then(fut, callback)

        DDP.register_comm_hook = register_strict  # type: ignore[method-assign]
        torch._C.Future.then = then_strict  # type: ignore[method-assign]
        try:
            yield self
        finally:
            DDP.register_comm_hook = register  # type: ignore[method-assign]
            torch._C.Future.then = then  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------ models
def _model(width: int = 2048) -> Any:
    """~4.2M parameters in one big layer: its bucket is above the sync-free selection's size cut-off."""
    import torch.nn as nn

    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _module(width: int = 2048) -> Any:
    import pytorch_lightning as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(width)

        def training_step(self, batch: Any, i: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Tiny()


def _loader(n: int = 256, seed: int = 0) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)),
                      batch_size=32)


def _fit(strategy: Any, steps: int, root: str) -> Any:
    import pytorch_lightning as pl

    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root)
    model = _module()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, _loader())
    changed = any(not bool((p.detach().cpu() == b).all()) for p, b in zip(model.parameters(), before))
    return trainer, changed


# ------------------------------------------------------------------------------------------- steps
def probe() -> int:
    try:
        import torch
    except ImportError as e:
        print(f"no CUDA device: torch is not importable ({e})")
        return NO_DEVICE
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(f"no CUDA device: torch {torch.__version__} sees none")
        return NO_DEVICE
    print(f"{torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    return 0


def syncs() -> int:
    """World size 1 on NCCL, sync-free path (the default on CUDA): every exchange the strategy can run on one
    process, exact and MSTopK, fp32 and bf16 wire values; the hooks run under sync debug mode "error"."""
    import torch

    from lightning_topk import TopKDDPStrategy

    os.environ.pop("LIGHTNING_TOPK_SYNC_FREE", None)  # the CUDA default: sync-free
    failed = 0
    with tempfile.TemporaryDirectory() as root:
        for exchange in ("allgather", "scatter", "auto", "dense"):
            for selector, wire in (("exact", "fp32"), ("mstopk", "bf16")):
                case = f"exchange={exchange} selector={selector} value_dtype={wire}"
                strict = StrictHooks()
                try:
                    with strict.installed():
                        s = TopKDDPStrategy(density=0.01, selector=selector, value_dtype=wire, exchange=exchange,
                                            process_group_backend="nccl")
                        trainer, changed = _fit(s, 4, root)
                    t = trainer.strategy.topk_state.totals
                    ok = strict.calls >= 4 and changed and trainer.global_step == 4
                    sparse = t.numel_sent < t.numel
                    if exchange in ("allgather", "scatter"):
                        ok = ok and sparse
                    print(f"{'ok  ' if ok else 'FAIL'} {case}: {strict.calls} hook calls, 0 host syncs inside, "
                          f"sent {t.numel_sent}/{t.numel} entries")
                    failed += not ok
                except Exception as e:  # a sync raises inside the hook: the step fails
                    failed += 1
                    print(f"FAIL {case}: {type(e).__name__}: {str(e)[:600]}")
                    traceback.print_exc(limit=6)
                torch.cuda.synchronize()
    return 1 if failed else 0


def _brackets(x: Any, k: int) -> Any:
    import torch

    a = torch.sort(x.abs().float().reshape(-1), descending=True).values
    return float(a[k // 2 - 1]), float(a[min(2 * k, a.numel() - 1)])


def _mtc(co: Any, a: Any, t: Any) -> bool:
    import torch

    return torch.equal(co.multi_threshold_count(a, t), co.multi_threshold_count_torch(a, t))


def _compact(co: Any, x: Any, hi: float, lo: float, k: int) -> bool:
    import torch

    v, i = co.compact_selected(x, hi, lo, k)
    rv, ri = co.compact_selected_torch(x, hi, lo, k)
    return torch.equal(i, ri) and torch.equal(v, rv)


def _indices_sync_free(co: Any, a: Any, thr: Any, k: int) -> bool:
    import torch

    co.compact_indices(a, thr, k)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        idx = co.compact_indices(a, thr, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return torch.equal(idx, co.compact_indices_torch(a, thr, k))


def _rebuild(co: Any, x: Any, k: int) -> bool:
    import torch

    n, dev = x.numel(), x.device
    idx = torch.randint(0, n, (k,), device=dev, generator=torch.Generator(device=dev).manual_seed(1),
                        dtype=torch.int32)
    vals = x[:k].clone()
    got = co.scatter_add_dense(torch.zeros(n, dtype=x.dtype, device=dev), vals, idx, 0.5)
    ref = co.scatter_add_dense_torch(torch.zeros(n, dtype=x.dtype, device=dev), vals, idx, 0.5)
    tol = {torch.float32: 1e-4, torch.float16: 0.1, torch.bfloat16: 0.5}[x.dtype]
    return torch.allclose(got.double(), ref.double(), atol=tol, rtol=0)


def _lars(co: Any, pdtype: Any) -> bool:
    import torch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    shapes = [(4096, 1024), (1024,), (25_000_000,), (3, 3, 64, 64), (0,)]
    ps = [torch.randn(s, device=dev, generator=gen).to(pdtype) for s in shapes]
    bufs = [torch.zeros(s, device=dev, dtype=torch.float32) for s in shapes]
    rps, rbufs = [p.clone() for p in ps], [b.clone() for b in bufs]
    adapt = [True, False, True, True, True]
    lrs, wds = [0.1, 0.2, 0.1, 0.05, 0.1], [1e-4, 0.0, 1e-4, 1e-4, 0.0]
    for step in range(4):
        gs = [torch.randn(s, device=dev, generator=gen).to(pdtype) for s in shapes]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")  # tables cached from step 2
        try:
            co.fused_lars_step(ps, gs, bufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, True, step == 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        co.fused_lars_step_torch(rps, gs, rbufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, True, step == 0)
    rtol = 1e-5 if pdtype == torch.float32 else 2 ** -7
    return all(torch.allclose(u.float(), v.float(), rtol=rtol, atol=1e-6) for u, v in zip(ps + bufs, rps + rbufs))


def kernels() -> int:
    """multi_threshold_count, compact_selected, compact_indices (selection), scatter_add_dense (rebuild) and
    fused_lars_step on CUDA through CuPy, against their torch references on the same device."""
    import torch

    from lightning_topk.ops import cuda as co

    if not co.cupy_available():
        print("FAIL CuPy is not usable here: the CUDA kernels fall back to torch, nothing to compare")
        return 1
    failed = 0

    def check(name: str, fn: Callable[..., bool], *args: Any) -> None:
        nonlocal failed
        try:
            ok = fn(co, *args)
        except Exception as e:
            ok = False
            print(f"     {name}: {type(e).__name__}: {str(e)[:400]}")
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        failed += not ok

    dev = torch.device("cuda")
    for n in (1_000_003, 25_000_000):
        g = torch.Generator(device=dev).manual_seed(n)
        base = torch.randn(n, device=dev, generator=g) * torch.exp(torch.randn(n, device=dev, generator=g))
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = base.to(dtype)
            a, k = x.abs(), max(2, n // 100)
            hi, lo = _brackets(x, k)
            t = torch.linspace(0, 3, 5000, device=dev)
            thr = torch.tensor([hi, lo], device=dev)
            tag = f"n={n:,} {str(dtype).split('.')[-1]}"
            check(f"multi_threshold_count {tag}", _mtc, a, t)
            check(f"compact_selected {tag}", _compact, x, hi, lo, k)
            check(f"compact_indices (sync debug 'error') {tag}", _indices_sync_free, a, thr, k)
            check(f"scatter_add_dense (rebuild) {tag}", _rebuild, x, k)
        del base
    for pdtype in (torch.float32, torch.float16, torch.bfloat16):
        check(f"fused_lars_step {str(pdtype).split('.')[-1]} (sync debug 'error' once cached)", _lars, pdtype)
    return 1 if failed else 0


def nccl1() -> int:
    """One process, NCCL, TopKDDPStrategy with its defaults (exchange="auto", sync-free path)."""
    import torch.distributed as dist

    from lightning_topk import TopKDDPStrategy

    with tempfile.TemporaryDirectory() as root:
        trainer, changed = _fit(TopKDDPStrategy(), 8, root)
        backend = dist.get_backend() if dist.is_initialized() else None
        loss = float(trainer.callback_metrics["loss"])
        t = trainer.strategy.topk_state.totals
    ok = backend == "nccl" and trainer.global_step == 8 and changed and loss == loss and t.numel > 0
    print(f"{'ok  ' if ok else 'FAIL'} backend={backend} global_step={trainer.global_step} params changed={changed} "
          f"loss={loss:.4f} exchanged {t.numel_sent}/{t.numel} entries, bytes sent {t.bytes_sent}")
    return 0 if ok else 1


def _gloo_rank(rank: int, world: int, port: int, out: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lightning_topk as lt
    from lightning_topk.comm import make_groups

    os.environ.pop("LIGHTNING_TOPK_SYNC_FREE", None)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: Dict[str, Any] = {}
    try:
        if mode == "probe":  # does gloo take CUDA tensors at all?
            t = torch.full((4,), float(rank + 1), device="cuda")
            dist.all_reduce(t)
            parts = [torch.empty(4, device="cuda") for _ in range(world)]
            dist.all_gather(parts, torch.full((4,), float(rank), device="cuda"))
            result = {"allreduce": t.tolist(), "allgather": [p.tolist() for p in parts]}
        else:
            torch.manual_seed(0)
            m = _model().cuda()
            ddp = DDP(m, device_ids=[0])
            hier = mode == "hierarchical"
            cfg = lt.TopKConfig(density=0.01, exchange="auto" if hier else mode, hierarchical=hier)
            st = lt.TopKState(cfg, hier=make_groups(2, 2, rank) if hier else None)
            st.bind(m.named_parameters())
            hooks = {"allgather": lt.topk_allgather_hook, "scatter": lt.scatter_topk_hook,
                     "hierarchical": lt.hierarchical_topk_hook}
            strict = StrictHooks()
            ddp.register_comm_hook(st, strict.wrap(hooks[mode]))
            ctl = lt.StepController(st)
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            g = torch.Generator().manual_seed(rank)
            with strict.installed():
                for _ in range(4):
                    x, y = torch.randn(32, 1, 8, 8, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()
                    opt.zero_grad()
                    nn.functional.cross_entropy(ddp(x), y).backward()
                    ctl.finish_step()
                    opt.step()
            torch.cuda.synchronize()
            result = {"params": [p.detach().cpu() for p in m.parameters()], "calls": strict.calls,
                      "sent": st.totals.numel_sent, "numel": st.totals.numel}
        torch.save(result, os.path.join(out, f"{mode}{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, mode: str, out: str) -> List[Any]:
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gloo_rank, args=(world, port, out, mode), nprocs=world, join=True, start_method="spawn")
    return [torch.load(os.path.join(out, f"{mode}{r}.pt")) for r in range(world)]


def gloo2() -> int:
    """2 processes on one GPU over gloo with CUDA tensors (flat all-gather and scatter exchanges), and 4 for
    the hierarchical one (2 simulated nodes of 2); hooks under sync debug mode "error"."""
    import torch

    with tempfile.TemporaryDirectory() as out:
        try:
            r = _spawn(2, "probe", out)
            ok = r[0]["allreduce"] == [3.0] * 4 and r[1]["allgather"] == [[0.0] * 4, [1.0] * 4]
        except Exception as e:
            print(f"SKIP gloo does not run collectives on CUDA tensors here: {type(e).__name__}: {str(e)[:400]}")
            return 0
        if not ok:
            print(f"FAIL gloo on CUDA tensors gave wrong results: {r}")
            return 1
        print("ok   gloo all_reduce and all_gather on CUDA tensors, 2 processes on one GPU")
        failed = 0
        for mode, world in (("allgather", 2), ("scatter", 2), ("hierarchical", 4)):
            try:
                ranks = _spawn(world, mode, out)
                same = all(torch.equal(a, b) for rk in ranks[1:] for a, b in zip(ranks[0]["params"], rk["params"]))
                ok = same and ranks[0]["calls"] >= 4 and ranks[0]["sent"] < ranks[0]["numel"]
                print(f"{'ok  ' if ok else 'FAIL'} {mode}, {world} processes: ranks identical={same}, "
                      f"{ranks[0]['calls']} strict hook calls, sent {ranks[0]['sent']}/{ranks[0]['numel']}")
            except Exception as e:
                ok = False
                print(f"FAIL {mode}, {world} processes: {type(e).__name__}: {str(e)[-800:]}")
            failed += not ok
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- topk_fsdp
def _fsdp_rank(rank: int, world: int, port: int, out: str, mode: str) -> None:
    """One of 4 processes on one GPU over gloo with CUDA tensors, as 2 simulated nodes of 2: torch's HSDP
    (``hsdp``), ``topk_fsdp``'s per-step exchange (``topk1``: density 1, fp32 values; ``topk01``: density 0.1)
    on the test suite's small net; or, for the memory table, a 4-block Transformer with AdamW under
    ``mem_hsdp`` / ``mem_topk_fsdp`` / ``mem_topk_ddp`` (peak and steady CUDA memory of this process)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from lightning_topk.comm.config import TopKConfig
    from lightning_topk.comm.sharded import ShardedTopK, make_mesh, shard_model

    dev = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this step's code without a GPU
    cuda = dev == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank % 2))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: Dict[str, Any] = {}
    try:
        mem = mode.startswith("mem_")
        torch.manual_seed(0)
        if mem:
            from lightning_topk.models.components.transformer import TransformerLM

            holder = nn.Module()
            holder.net = TransformerLM(256, d_model=int(os.environ.get("GPU_CHECK_MEM_D", 1024)), layers=4, heads=8, ff_mult=4, max_len=128, dropout=0.0)
            blocks = list(holder.net.blocks.layers)
        else:
            class Block(nn.Module):
                def __init__(self, d: int) -> None:
                    super().__init__()
                    self.l1, self.l2, self.n = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

                def forward(self, x: Any) -> Any:
                    return x + self.l2(torch.relu(self.l1(self.n(x))))

            class Net(nn.Module):
                def __init__(self, d: int = 16) -> None:
                    super().__init__()
                    self.emb, self.head = nn.Linear(8, d), nn.Linear(d, 3)
                    self.blocks = nn.ModuleList([Block(d), Block(d)])

                def forward(self, x: Any) -> Any:
                    h = self.emb(x)
                    for b in self.blocks:
                        h = b(h)
                    return self.head(h)

            holder = nn.Module()
            holder.net = Net()
            blocks = list(holder.net.blocks)
        holder.to(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        top = ddp = st = None
        if mode in ("hsdp", "mem_hsdp"):
            mesh = make_mesh(dev, 2, 2)
            for b in blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(holder.net, mesh=mesh)
            model: Any = holder.net
        elif mode == "mem_topk_ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            import lightning_topk as lt

            model = ddp = DDP(holder.net, device_ids=[0] if cuda else None)
            st = lt.TopKState(lt.TopKConfig(density=0.01, exchange="allgather"))
            st.bind(holder.net.named_parameters())
            ddp.register_comm_hook(st, lt.topk_allgather_hook)
            ctl = lt.StepController(st)
        else:
            mesh = make_mesh(dev, 2, 2)
            shard_model(holder, mesh)
            density = {"topk1": 1.0, "topk01": 0.1}.get(mode, 0.01)
            vdt = "fp32" if mode in ("topk1", "topk01") else "bf16"
            top = ShardedTopK(TopKConfig(density=density, exchange="allgather", value_dtype=vdt, min_sparse_numel=0),
                              holder, mesh)
            model = holder.net
        params = list(holder.parameters())
        opt = (torch.optim.AdamW(params, lr=1e-4) if mem else torch.optim.SGD(params, lr=0.1, momentum=0.9))
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(3 if mem else 6):
            if mem:
                x = torch.randint(0, 256, (4, 129), generator=g).to(dev)
                logits = model(x[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
            else:
                x, y = torch.randn(16, 8, generator=g).to(dev), torch.randint(0, 3, (16,), generator=g).to(dev)
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if top is not None:
                top.before_optimizer_step()
            if ddp is not None:
                ctl.finish_step()
            opt.step()
            opt.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        if mem:
            n = sum(p.numel() for p in holder.net.parameters()) if ddp is not None else \
                sum(p.full_tensor().numel() if hasattr(p, "full_tensor") else p.numel() for p in params)
            result = {"params": n, "steady": (torch.cuda.memory_allocated() - base) if cuda else 0,
                      "peak": (torch.cuda.max_memory_allocated() - base) if cuda else 0, "loss": float(loss.detach())}
        else:
            result = {"full": {n: p.full_tensor().detach().cpu() for n, p in holder.named_parameters()},
                      "step": top.state.step if top is not None else None}
        torch.save(result, os.path.join(out, f"{mode}{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fsdp() -> int:
    """topk_fsdp on CUDA tensors: 4 processes on one GPU over gloo (2 simulated nodes x 2) against torch's HSDP
    at density 1, and the per-rank CUDA memory of HSDP, topk_fsdp and topk_ddp on a 4-block Transformer with
    AdamW; then a world-size-1 NCCL Trainer run of topk_fsdp and topk_fsdp_local in bf16-mixed."""
    import json
    import socket
    import subprocess

    import torch
    import torch.multiprocessing as mp

    def spawn(mode: str, out: str) -> List[Any]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_fsdp_rank, args=(4, port, out, mode), nprocs=4, join=True, start_method="spawn")
        return [torch.load(os.path.join(out, f"{mode}{r}.pt")) for r in range(4)]

    failed = 0
    with tempfile.TemporaryDirectory() as out:
        try:
            ref, dense, sparse = (spawn(m, out) for m in ("hsdp", "topk1", "topk01"))
            diff = max(float((ref[0]["full"][k] - dense[0]["full"][k]).abs().max()) for k in ref[0]["full"])
            agree = all(torch.equal(sparse[0]["full"][k], s["full"][k]) for s in sparse[1:] for k in ref[0]["full"])
            moved = max(float((ref[0]["full"][k] - sparse[0]["full"][k]).abs().max()) for k in ref[0]["full"])
            ok = diff <= 1e-6 and agree and moved > 1e-4 and dense[0]["step"] == 6
            print(f"{'ok  ' if ok else 'FAIL'} topk_fsdp 2x2 on CUDA over gloo: density 1 vs torch HSDP max|d|={diff:.2e}"
                  f" (<= 1e-6); density 0.1: replicas identical={agree}, differs from HSDP by {moved:.2e}")
            failed += not ok
        except Exception as e:
            print(f"SKIP topk_fsdp 2x2 on CUDA over gloo: {type(e).__name__}: {str(e)[-600:]}")
        rows = {}
        for m in ("mem_hsdp", "mem_topk_fsdp", "mem_topk_ddp"):
            try:
                r = spawn(m, out)
                rows[m] = {k: max(x[k] for x in r) for k in ("steady", "peak")} | {"params": r[0]["params"],
                                                                                  "loss": r[0]["loss"]}
            except Exception as e:
                print(f"SKIP memory {m}: {type(e).__name__}: {str(e)[-400:]}")
        if rows:
            print("memory per rank (CUDA allocator, max over 4 ranks; AdamW, 4-block Transformer d=1024):")
            for m, r in rows.items():
                print(f"  {m[4:]:10s} params {r['params'] / 1e6:.1f}M steady {r['steady'] / 2**20:8.1f} MiB "
                      f"peak {r['peak'] / 2**20:8.1f} MiB loss {r['loss']:.3f}")
            if "mem_topk_ddp" in rows and "mem_topk_fsdp" in rows and rows["mem_topk_ddp"]["steady"] > 0:
                print(f"  topk_fsdp / topk_ddp steady {rows['mem_topk_fsdp']['steady'] / rows['mem_topk_ddp']['steady']:.3f}"
                      f", peak {rows['mem_topk_fsdp']['peak'] / rows['mem_topk_ddp']['peak']:.3f}")
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "gpu_fsdp_memory.json"), "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "rows": rows}, f,
                              indent=1)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "scripts", "fsdp_train.py")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
                   NODE_RANK="0")
        ref_loss = float("nan")
        for name, extra in (("hsdp", ["--strategy", "hsdp", "--precision", "32-true"]),
                            ("topk1", ["--density", "1", "--value-dtype", "fp32", "--precision", "32-true"]),
                            ("topk_bf16", ["--precision", "bf16-mixed"]),
                            ("local_bf16", ["--precision", "bf16-mixed", "--local-steps", "4"])):
            o = os.path.join(out, name)
            cmd = [sys.executable, script, "--accelerator", "gpu" if torch.cuda.is_available() else "cpu", "--devices", "1", "--nodes", "1", "--steps", "30",
                   "--optimizer", "adamw", "--out", o] + extra
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if p.returncode:
                print(f"FAIL fsdp_train {name} on NCCL world size 1: exit {p.returncode}\n{p.stderr[-1500:]}")
                failed += 1
                continue
            info = torch.load(o + ".rank0")
            ok = info["step"] == 30 and info["loss"] < 4.1  # ln(64) = 4.16 at the start
            if name == "hsdp":
                ref_loss = info["loss"]
            else:
                ok = ok and abs(info["loss"] - ref_loss) < 0.1
            print(f"{'ok  ' if ok else 'FAIL'} fsdp_train {name} on NCCL world size 1: step {info['step']} loss "
                  f"{info['loss']:.4f} param dtype {info['param_dtype']}")
            failed += not ok
        try:
            a, b = torch.load(os.path.join(out, "hsdp")), torch.load(os.path.join(out, "topk1"))
            d = max(float((a[k] - b[k]).abs().max()) for k in a)
            print(f"{'ok  ' if d <= 1e-6 else 'FAIL'} world size 1: topk_fsdp density 1 vs HSDP max|d|={d:.2e}")
            failed += d > 1e-6
        except Exception as e:
            print(f"FAIL comparing the world-size-1 runs: {e}")
            failed += 1
    return 1 if failed else 0


STEPS: Dict[str, Callable[[], int]] = {"probe": probe, "syncs": syncs, "kernels": kernels, "nccl1": nccl1,
                                       "gloo2": gloo2, "fsdp": fsdp}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in STEPS:
        print(f"usage: {sys.argv[0]} {{{','.join(STEPS)}}}", file=sys.stderr)
        sys.exit(2)
    sys.exit(STEPS[sys.argv[1]]())
