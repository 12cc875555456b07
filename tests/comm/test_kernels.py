"""CUDA kernels of lightning_topk.ops.cuda.

No GPU here: (a) every kernel source compiles with nvcc and with NVRTC (what CuPy's RawModule uses)
into a cubin that exports the expected unmangled kernels; (b) the torch references match brute force;
(c) the dispatchers fall back to torch on CPU without importing CuPy; (d) NumPy emulations of the
kernels' block-level logic (tile counts + block scans, per-block histograms, bf16 rounding, LARS
chunk tables) reproduce the references. GPU tests at the end run only where CUDA and CuPy are present.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import re
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_topk.ops import cuda as co
from tests.helpers.procs import ROOT
from tests.helpers.syncs import count_syncs

KDIR = ROOT / "kernels"
ARCHS = ("sm_70", "sm_80", "sm_90")
NVCC = shutil.which("nvcc")
GPU = torch.cuda.is_available() and co.cupy_available()


# ------------------------------------------------------------------------------ (a) compilation
def _kernel_sections(cubin: bytes):
    return set(m.decode() for m in re.findall(rb"\.text\.([A-Za-z_][A-Za-z0-9_]*)\x00", cubin))


@pytest.fixture(scope="module")
def nvcc_archs():
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    out = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return set(a.replace("compute_", "sm_") for a in out.split())


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel_file(arch, nvcc_archs, tmp_path):
    if arch not in nvcc_archs:
        pytest.skip(f"this nvcc cannot target {arch} (CUDA 13 dropped sm_50-sm_72); it supports {sorted(nvcc_archs)}")
    files = sorted(KDIR.glob("*.cu"))
    assert {f.stem for f in files} == set(co.KERNEL_FILES)
    r = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "--Werror", "all-warnings", *co.NVRTC_OPTIONS[1:],
                        "-odir", str(tmp_path), *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for f in files:
        cubin = (tmp_path / f"{f.stem}.cubin").read_bytes()
        # extern "C": kernels are found by their plain names, exactly the ones the loader asks for
        assert _kernel_sections(cubin) == set(co.KERNEL_FILES[f.stem]), f.name


def _nvrtc():
    cands = glob.glob(str(Path(site.getsitepackages()[0]) / "nvidia" / "*" / "lib" / "libnvrtc.so*"))
    cands += [p for p in (ctypes.util.find_library("nvrtc"),) if p]
    for path in cands:
        if "builtins" in path:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _nvrtc_compile(lib, src: str, name: str, opts):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    o = [s.encode() for s in opts]
    rc = lib.nvrtcCompileProgram(prog, len(o), (ctypes.c_char_p * len(o))(*o))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = b""
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), cubin


@pytest.mark.parametrize("name", sorted(co.KERNEL_FILES))
def test_nvrtc_compiles_loader_source(name):
    """The exact string RawModule(code=...) gets, with the loader's options, compiles with NVRTC."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc for this check)")
    src = co.kernel_source(name)
    assert not re.search(r"^\s*#include", src, re.M)  # NVRTC gets no include path: the loader inlines common.cuh
    for arch in ("sm_80", "sm_90"):
        rc, log, cubin = _nvrtc_compile(lib, src, f"{name}.cu", [*co.NVRTC_OPTIONS, f"--gpu-architecture={arch}"])
        assert rc == 0, log
        assert "warning" not in log.lower(), log
        assert _kernel_sections(cubin) == set(co.KERNEL_FILES[name])


def test_sources_have_no_host_code_and_constants_agree():
    for f in KDIR.glob("*.cu"):
        text = f.read_text()
        assert not re.search(r"#include\s*<", text), f"{f.name}: system header (NVRTC has none)"
        assert "int main" not in text and "cudaMalloc" not in text and "<<<" not in text
        for line in text.splitlines():  # every kernel entry point is extern "C"
            if "__global__" in line and not line.lstrip().startswith("//"):
                assert 'extern "C" __global__' in line, f"{f.name}: {line.strip()}"
    common = (KDIR / "common.cuh").read_text()
    for dt, code in co._DTYPE_CODE.items():
        name = {torch.float32: "LT_F32", torch.float16: "LT_F16", torch.bfloat16: "LT_BF16"}[dt]
        assert re.search(rf"#define {name} {code}\b", common)
    compact = (KDIR / "compact.cu").read_text()
    blk = int(re.search(r"#define LT_CBLOCK (\d+)", compact).group(1))
    items = int(re.search(r"#define LT_CITEMS (\d+)", compact).group(1))
    assert blk * items == co._COMPACT_TILE and blk == co._BLOCK
    assert f"#define LT_CHUNK {co._LARS_CHUNK}" in (KDIR / "fused_lars.cu").read_text()


def test_kernel_source_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown kernel file 'nope'.*allowed"):
        co.kernel_source("nope")


# --------------------------------------------------------------- (b) torch references vs brute force
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data(n, seed, dtype=torch.float32, levels=None):
    x = torch.randn(n, generator=_gen(seed))
    if levels:  # many exact duplicates and ties
        x = torch.round(x * levels) / levels
    return x.to(dtype)


def _brute_counts(absx, thresholds):
    cdt = torch.float64 if absx.dtype == torch.float64 else torch.float32
    a = absx.reshape(-1).to(cdt)
    return torch.tensor([int((a >= t).sum()) for t in thresholds.to(cdt)], dtype=torch.int64)


def test_multi_threshold_count_makes_no_host_reads():
    x = _data(50_000, 8).abs()
    t = torch.tensor([0.5, float("nan"), 2.0, 0.0])
    with count_syncs() as c:
        got = co.multi_threshold_count(x, t)
    assert c.total == 0, c.calls
    assert torch.equal(got, _brute_counts(x, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_multi_threshold_count_reference(dtype):
    x = _data(20_000, 1, dtype, levels=8).abs()
    x[::97] = float("nan")
    x[5] = float("inf")
    vals = x.float()[:6].tolist()  # thresholds equal to data values: ties count (>=)
    t = torch.tensor([0.5, 0.1, float("nan"), 3.0, 0.5, 0.0, -1.0, float("inf"), 1e-9] + vals)
    got = co.multi_threshold_count_torch(x, t)
    assert got.dtype == torch.int64 and got.shape == t.shape
    assert torch.equal(got, _brute_counts(x, t))
    assert got[2] == 0 and got[6] == x.numel() - int(torch.isnan(x.float()).sum())
    x2 = x.reshape(100, 200)  # any shape
    assert torch.equal(co.multi_threshold_count_torch(x2, t), got)


def test_multi_threshold_count_empty_inputs():
    assert torch.equal(co.multi_threshold_count_torch(torch.empty(0), torch.tensor([0.0, 1.0])),
                       torch.zeros(2, dtype=torch.int64))
    assert co.multi_threshold_count_torch(torch.rand(10), torch.empty(0)).numel() == 0
    with pytest.raises(ValueError, match="thresholds must be a 1-D tensor"):
        co.multi_threshold_count(torch.rand(10), torch.tensor(1.0))
    with pytest.raises(TypeError, match="absx must be a floating-point tensor"):
        co.multi_threshold_count(torch.arange(10), torch.tensor([1.0]))


def _brute_compact(x, hi, lo, k):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = x.abs().to(cdt).tolist()
    hi, lo = float(torch.tensor(hi, dtype=cdt)), float(torch.tensor(lo, dtype=cdt))
    top = [i for i, v in enumerate(a) if v >= hi]
    band = [i for i, v in enumerate(a) if lo <= v < hi]
    assert len(top) <= k <= len(top) + len(band)
    return top + band[: k - len(top)]


def _brackets(x, k, lo_factor=0.8):
    """hi: the smallest magnitude above the k-th largest (count <= k); lo: lo_factor * the k-th (count >= k)."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = torch.sort(x.abs().to(cdt), descending=True).values
    kth = float(a[k - 1])
    hi = float(a[a > kth].min()) if bool((a > kth).any()) else float("inf")
    return hi, kth * lo_factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("levels", [None, 16])
def test_compact_selected_reference(dtype, levels):
    x = _data(30_001, 2, dtype, levels=levels)
    k = 700
    hi, lo = _brackets(x, k)
    vals, idx = co.compact_selected_torch(x, hi, lo, k)
    assert idx.dtype == torch.int32 and vals.dtype == dtype and idx.numel() == k
    assert idx.tolist() == _brute_compact(x, hi, lo, k)          # same set and the documented order
    assert torch.equal(vals, x[idx.long()])
    # with the band starting at the k-th magnitude, the set is a top-k set (ties broken by index)
    hi, lo = _brackets(x, k, lo_factor=1.0)
    vals, idx = co.compact_selected_torch(x, hi, lo, k)
    assert idx.tolist() == _brute_compact(x, hi, lo, k)
    ref = torch.topk(x.abs().double(), k).values
    assert torch.equal(torch.sort(vals.abs().double(), descending=True).values, ref)


def test_compact_selected_band_slice_is_first_in_index_order():
    x = torch.zeros(5000)
    x[[10, 4000]] = 5.0                    # hi entries
    x[[3, 7, 2500, 2501, 4999]] = 1.0      # band, all tied
    vals, idx = co.compact_selected_torch(x, 2.0, 0.5, 5)
    assert idx.tolist() == [10, 4000, 3, 7, 2500]
    assert vals.tolist() == [5.0, 5.0, 1.0, 1.0, 1.0]


def test_compact_selected_edges_and_errors():
    v, i = co.compact_selected_torch(torch.empty(0), 1.0, 0.5, 0)
    assert v.numel() == 0 and i.dtype == torch.int32
    x = torch.tensor([0.1, -3.0, float("nan"), 2.0, -0.7, float("inf")])
    v, i = co.compact_selected(x, 2.5, 0.5, 4)         # hi: -3, inf; band (index order): 2.0, -0.7
    assert i.tolist() == [1, 5, 3, 4] and v[:1].item() == -3.0
    with pytest.raises(ValueError, match="count_hi <= k"):
        co.compact_selected(x, 0.5, 0.1, 2)             # 4 entries >= hi but k = 2
    with pytest.raises(ValueError, match="count_hi <= k"):
        co.compact_selected(x, 2.5, 1.0, 5)             # only 3 entries >= lo
    with pytest.raises(ValueError, match="k must be a non-negative int"):
        co.compact_selected(x, 2.5, 1.0, -1)
    with pytest.raises(ValueError, match="x must be 1-D"):
        co.compact_selected(x.reshape(2, 3), 2.5, 1.0, 1)
    with pytest.raises(TypeError, match="threshold_hi must be a number"):
        co.compact_selected(x, "2", 1.0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("levels", [None, 16])
def test_compact_indices_reference_is_compact_selected_without_reads(dtype, levels):
    x = _data(30_001, 5, dtype, levels=levels)
    k = 700
    hi, lo = _brackets(x, k)
    _, ref = co.compact_selected_torch(x, hi, lo, k)
    a = x.abs()
    with count_syncs() as c:
        got = co.compact_indices(a, torch.tensor([hi, lo]), k)
    assert c.total == 0, c.calls
    assert got.dtype == torch.int64 and torch.equal(got, ref.long())   # same set, same order
    scratch = (torch.empty(a.numel(), dtype=torch.bool), torch.empty(a.numel(), dtype=torch.bool))
    assert torch.equal(co.compact_indices_torch(a, torch.tensor([hi, lo]), k, scratch), got)


def test_compact_indices_out_of_contract_and_errors():
    a = torch.tensor([0.1, 3.0, float("nan"), 2.0, 0.7, float("inf")])
    assert co.compact_indices(a, torch.tensor([2.5, 0.5]), 4).tolist() == [1, 5, 3, 4]
    assert co.compact_indices(a, torch.tensor([0.5, 0.1]), 2).tolist() == [1, 3]      # > k entries >= hi
    assert co.compact_indices(a, torch.tensor([2.5, 1.0]), 5).tolist() == [1, 5, 3, 0, 0]  # too few >= lo
    assert co.compact_indices(a, torch.tensor([2.5, 1.0]), 0).numel() == 0
    with pytest.raises(ValueError, match="thresholds must be a tensor \\[hi, lo\\]"):
        co.compact_indices(a, torch.tensor([1.0]), 2)
    with pytest.raises(ValueError, match="k must be a non-negative int"):
        co.compact_indices(a, torch.tensor([1.0, 0.5]), -1)
    with pytest.raises(ValueError, match="absx must be 1-D"):
        co.compact_indices(a.reshape(2, 3), torch.tensor([1.0, 0.5]), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_scatter_add_reference_duplicates_add(dtype):
    g = _gen(3)
    n, nnz = 1000, 4000                       # 4 gathered buffers of 1000 picks: many duplicates
    out0 = torch.randn(n, generator=g).to(dtype)
    vals = torch.randn(nnz, generator=g).to(dtype)
    idx = torch.randint(0, n, (nnz,), generator=g, dtype=torch.int32)
    idx[:10] = 7                               # the same index from every rank
    got = co.scatter_add_dense_torch(out0.clone(), vals, idx, 0.25)
    brute = out0.double().clone()
    prod = (vals * 0.25).double()              # the product is rounded to out's dtype first
    for i, j in enumerate(idx.tolist()):
        brute[j] += prod[i]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 0.05, torch.bfloat16: 0.3}[dtype]
    assert torch.allclose(got.double(), brute, atol=tol, rtol=0)
    assert got.dtype == dtype
    # scale 1 and int64 indices through the dispatcher (CPU: torch path)
    out = co.scatter_add_dense(torch.zeros(n, dtype=dtype), vals, idx.long())
    assert torch.allclose(out.double(), torch.zeros(n, dtype=torch.float64).index_add_(0, idx.long(), vals.double()),
                          atol=tol, rtol=0)


def test_scatter_add_edges_and_errors():
    out = torch.ones(4)
    assert torch.equal(co.scatter_add_dense(out, torch.empty(0), torch.empty(0, dtype=torch.int32), 2.0), torch.ones(4))
    for bad in (4, -1):
        with pytest.raises(IndexError):
            co.scatter_add_dense(torch.zeros(4), torch.ones(1), torch.tensor([bad], dtype=torch.int32))
    with pytest.raises(TypeError, match="values dtype torch.float16 must equal out dtype torch.float32"):
        co.scatter_add_dense(torch.zeros(4), torch.ones(1, dtype=torch.float16), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(TypeError, match="indices must be a 1-D int32"):
        co.scatter_add_dense(torch.zeros(4), torch.ones(1), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="2 indices for 1 values"):
        co.scatter_add_dense(torch.zeros(4), torch.ones(1), torch.tensor([0, 1], dtype=torch.int32))


def _lars_brute(params, grads, bufs, lrs, wds, adapt, momentum, tc, eps, nesterov, first):
    """Per-parameter LARS loop, the way timm's Lars is written (fp32 math)."""
    for i, (p, g, b) in enumerate(zip(params, grads, bufs)):
        p32, g32 = p.float(), g.float()
        d = g32
        if adapt[i]:
            w, gn = torch.norm(p32), torch.norm(g32)
            trust = tc * w / (gn + wds[i] * w + eps) if (w > 0 and gn > 0) else torch.tensor(1.0)
            d = trust * (g32 + wds[i] * p32)
        nb = d.clone() if first[i] else momentum * b.float() + d
        upd = d + momentum * nb if nesterov else nb
        p.copy_(p32 - lrs[i] * upd)
        b.copy_(nb)


def _lars_problem(seed, pdtype=torch.float32, bdtype=torch.float32):
    g = _gen(seed)
    shapes = [(64, 3, 3, 3), (64,), (64,), (128, 64), (0,), (10,), (257, 33), (5,)]
    ps = [torch.randn(s, generator=g).to(pdtype) for s in shapes]
    ps[5].zero_()                              # ||p|| == 0 -> trust 1
    bufs = [torch.zeros(s, dtype=bdtype) for s in shapes]
    adapt = [True, False, False, True, True, True, True, True]
    lrs = [0.1, 0.1, 0.05, 0.1, 0.1, 0.1, 0.2, 0.1]
    wds = [5e-4, 0.0, 0.0, 5e-4, 5e-4, 1e-3, 5e-4, 5e-4]
    return shapes, ps, bufs, adapt, lrs, wds


def _grads(shapes, step, dtype):
    g = _gen(100 + step)
    gs = [torch.randn(s, generator=g).to(dtype) * 0.1 for s in shapes]
    gs[7].zero_()                              # ||g|| == 0 -> trust 1
    return gs


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("pdtype,bdtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)])
def test_fused_lars_reference_matches_per_parameter_loop(nesterov, pdtype, bdtype):
    shapes, ps, bufs, adapt, lrs, wds = _lars_problem(4, pdtype, bdtype)
    ps2, bufs2 = [p.clone() for p in ps], [b.clone() for b in bufs]
    for step in range(15):
        gs = _grads(shapes, step, pdtype)
        first = [step == 0] * len(ps)
        if step == 3:
            first[3] = True                    # a buffer created late (param without grad before)
        co.fused_lars_step_torch(ps, gs, bufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, nesterov, first)
        _lars_brute(ps2, gs, bufs2, lrs, wds, adapt, 0.9, 0.001, 1e-8, nesterov, first)
        if pdtype != torch.float32:            # one rounding flip of a 16-bit store is allowed
            for a, b in zip(ps, ps2):
                assert torch.allclose(a.float(), b.float(), atol=0, rtol=2 ** -7)
            ps2 = [p.clone() for p in ps]
            bufs2 = [b.clone() for b in bufs]
    if pdtype == torch.float32:
        for a, b in zip(ps + bufs, ps2 + bufs2):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert all(p.dtype == pdtype for p in ps) and all(b.dtype == bdtype for b in bufs)
    assert not torch.equal(ps[0].float(), _lars_problem(4, pdtype, bdtype)[1][0].float())


def test_fused_lars_step_dispatcher_and_errors():
    shapes, ps, bufs, adapt, lrs, wds = _lars_problem(5)
    ps2, bufs2 = [p.clone() for p in ps], [b.clone() for b in bufs]
    gs = _grads(shapes, 0, torch.float32)
    co.fused_lars_step(ps, gs, bufs, 0.1, 5e-4, True, 0.9, 0.02, 1e-9, True, True)  # scalars broadcast
    _lars_brute(ps2, gs, bufs2, [0.1] * 8, [5e-4] * 8, [True] * 8, 0.9, 0.02, 1e-9, True, [True] * 8)
    for a, b in zip(ps, ps2):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    co.fused_lars_step([], [], [], 0.1, 0.0, True, 0.9, 0.001, 1e-8)                  # nothing to do
    with pytest.raises(ValueError, match="lrs has 2 entries for 8 tensors"):
        co.fused_lars_step(ps, gs, bufs, [0.1, 0.2], 0.0, True, 0.9, 0.001, 1e-8)
    with pytest.raises(ValueError, match="shapes param"):
        co.fused_lars_step(ps[:1], gs[1:2], bufs[:1], 0.1, 0.0, True, 0.9, 0.001, 1e-8)
    with pytest.raises(ValueError, match="8 params, 7 grads"):
        co.fused_lars_step(ps, gs[:7], bufs, 0.1, 0.0, True, 0.9, 0.001, 1e-8)


def test_lars_device_tables_are_validated_once_and_cached():
    """The CUDA path's tables: built (and the tensors validated) for a new set of addresses, reused after."""
    co._LARS_TABLES.clear()
    shapes, ps, bufs, adapt, _, _ = _lars_problem(15)
    gs = _grads(shapes, 0, torch.float32)
    first = [False] * len(ps)
    tables = co._lars_device_tables(ps, gs, bufs, adapt, first)
    meta, chunks = co._lars_tables(ps, gs, bufs, adapt, first)
    assert torch.equal(tables[0], torch.tensor(meta)) and torch.equal(tables[1], torch.tensor(chunks))
    assert co._lars_device_tables(ps, gs, bufs, adapt, first) is tables
    assert co._lars_device_tables(ps, gs, bufs, adapt, [True] * len(ps)) is not tables   # flags are in the key
    with pytest.raises(ValueError, match="tensor 0: shapes param"):
        co._lars_device_tables(ps, [torch.randn(3)] + gs[1:], bufs, adapt, first)
    strided = ps[:3] + [torch.randn(64, 128).t()] + ps[4:]                               # not contiguous
    assert co._lars_device_tables(strided, gs, bufs, adapt, first) is None
    for i in range(2 * co._LARS_TABLES_KEPT):
        co._lars_device_tables(ps, gs, bufs, adapt, [bool(i >> j & 1) for j in range(len(ps))])
    assert len(co._LARS_TABLES) == co._LARS_TABLES_KEPT
    co._LARS_TABLES.clear()


# ------------------------------------------------------------------------------- (c) dispatch on CPU
def test_import_does_not_import_cupy_and_cpu_falls_back():
    code = (
        "import sys, torch\n"
        "from lightning_topk.ops import cuda as co\n"
        "assert 'cupy' not in sys.modules\n"
        "x = torch.randn(50000)\n"
        "c = co.multi_threshold_count(x.abs(), torch.tensor([0.5, 1.0]))\n"
        "assert c.tolist() == [int((x.abs() >= 0.5).sum()), int((x.abs() >= 1.0).sum())]\n"
        "v, i = co.compact_selected(x, 3.0, 2.0, int((x.abs() >= 3.0).sum()) + 1)\n"
        "o = co.scatter_add_dense(torch.zeros(10), torch.ones(3), torch.tensor([1, 1, 2], dtype=torch.int32))\n"
        "assert o.tolist()[:3] == [0.0, 2.0, 1.0]\n"
        "assert 'cupy' not in sys.modules, 'CPU tensors must not touch CuPy'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_missing_cupy_names_the_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)            # import cupy -> ImportError
    monkeypatch.delenv("LIGHTNING_TOPK_DISABLE_CUPY", raising=False)
    co.cupy_available.cache_clear()
    co._module.cache_clear()
    co._warn_torch_fallback_on_cuda.cache_clear()
    try:
        assert co.cupy_available() is False
        with pytest.raises(ImportError, match=r"lightning-topk\[cuda12\].*lightning-topk\[cuda13\]"):
            co._module("compact")
        with pytest.warns(RuntimeWarning, match=r"torch references.*\[cuda13\]"):
            assert co._use_cupy(types.SimpleNamespace(is_cuda=True)) is False   # a CUDA tensor, as seen here
        assert co._use_cupy(torch.zeros(1)) is False
    finally:
        co.cupy_available.cache_clear()
        co._module.cache_clear()
        co._warn_torch_fallback_on_cuda.cache_clear()


def test_pyproject_extras_pin_one_cupy_per_cuda_major():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^cuda12 = \["cupy-cuda12x>=13"\]$', text, re.M)
    assert re.search(r'^cuda13 = \["cupy-cuda13x>=13\.6"\]$', text, re.M)   # the first cupy-cuda13x release


def test_cupy_available_is_false_here_or_disabled(monkeypatch):
    monkeypatch.setenv("LIGHTNING_TOPK_DISABLE_CUPY", "1")
    co.cupy_available.cache_clear()
    try:
        assert co.cupy_available() is False
        x = torch.rand(100)
        assert torch.equal(co.multi_threshold_count(x, torch.tensor([0.5])), co.multi_threshold_count_torch(x, torch.tensor([0.5])))
    finally:
        co.cupy_available.cache_clear()


# --------------------------------------------------------------- (d) NumPy emulation of kernel logic
def _emu_block_exclusive_scan(v):
    """common.cuh lt_block_exclusive_scan over the last axis (256 threads = 8 warps of 32 lanes)."""
    w = v.reshape(*v.shape[:-1], 8, 32).astype(np.uint32)
    x = w.copy()
    for d in (1, 2, 4, 8, 16):                 # __shfl_up_sync Hillis-Steele, lanes < d keep theirs
        y = np.zeros_like(x)
        y[..., d:] = x[..., :-d]
        x = x + y
    tot = x[..., 31]                           # lane 31 of each warp
    ws = np.concatenate([tot, np.zeros((*tot.shape[:-1], 24), np.uint32)], axis=-1)
    s = ws.copy()
    for d in (1, 2, 4, 8, 16):
        y = np.zeros_like(s)
        y[..., d:] = s[..., :-d]
        s = s + y
    excl_w = (s - ws)[..., :8]
    res = excl_w[..., None] + x - w
    return res.reshape(v.shape), s[..., 31]


def _emu_compact(x: torch.Tensor, hi: float, lo: float, k: int, check: bool = True):
    """compact.cu: compact_count (tile counts) -> _compact_offsets -> compact_write (row scans).
    ``check``: compact_selected (totals read back and checked); else compact_indices (no read)."""
    tile, block, items = co._COMPACT_TILE, co._BLOCK, co._COMPACT_TILE // co._BLOCK
    a = np.abs(x.float().numpy())
    hi32, lo32 = np.float32(hi), np.float32(lo)
    with np.errstate(invalid="ignore"):
        flag = np.where(a >= hi32, 1, np.where(a >= lo32, 65536, 0)).astype(np.uint32)
    n = a.size
    nb = (n + tile - 1) // tile
    tiles = np.zeros(nb * tile, np.uint32)
    tiles[:n] = flag
    tiles = tiles.reshape(nb, items, block)    # row r of tile b: entries b*tile + r*256 + thread
    per_thread = tiles.sum(axis=1, dtype=np.uint32)
    _, total = _emu_block_exclusive_scan(per_thread)
    counts = np.stack([total & 0xFFFF, total >> 16], axis=1).astype(np.int64)
    offsets, totals = co._compact_offsets(torch.from_numpy(counts if nb else np.zeros((1, 2), np.int64)))
    if check:
        co._check_totals(*totals.tolist(), k)
    offsets, count_hi = offsets.numpy(), int(totals[0])
    out = np.full(k, -1, np.int64)
    rank, row_tot = _emu_block_exclusive_scan(tiles)
    for b in range(nb):
        hi_pos, band_pos = int(offsets[b, 0]), count_hi + int(offsets[b, 1])
        if hi_pos >= k and band_pos >= k:
            continue
        for r in range(items):
            f, rk = tiles[b, r].astype(np.int64), rank[b, r].astype(np.int64)
            pos = np.where(f == 1, hi_pos + (rk & 0xFFFF), np.where(f == 65536, band_pos + (rk >> 16), -1))
            sel = (pos >= 0) & (pos < k)
            assert (out[pos[sel]] == -1).all()  # no slot written twice
            out[pos[sel]] = b * tile + r * block + np.nonzero(sel)[0]
            hi_pos += int(row_tot[b, r] & 0xFFFF)
            band_pos += int(row_tot[b, r] >> 16)
    if check:
        assert (out >= 0).all()                # every slot written
    return np.where(out >= 0, out, 0)          # compact_indices: slots nobody writes keep the zeros


def test_emulated_block_scan_is_an_exclusive_prefix_sum():
    v = np.random.default_rng(0).integers(0, 70000, size=(5, 256)).astype(np.uint32)
    res, tot = _emu_block_exclusive_scan(v)
    assert np.array_equal(res, np.cumsum(v, axis=1, dtype=np.uint32) - v)
    assert np.array_equal(tot, v.sum(axis=1, dtype=np.uint32))


@pytest.mark.parametrize("n,k,levels", [(4096, 50, None), (100_003, 900, 32), (9000, 1, 4), (300, 300, None)])
def test_emulated_compaction_matches_reference(n, k, levels):
    x = _data(n, 6 + n, levels=levels)
    if k == n:
        hi, lo = float("inf"), 0.0
    else:
        hi, lo = _brackets(x, k)
    _, ref = co.compact_selected_torch(x, hi, lo, k)
    assert np.array_equal(_emu_compact(x, hi, lo, k), ref.long().numpy())
    # the sync-free entry point: the same kernels without the check, on magnitudes
    thr = torch.tensor([hi, lo])
    assert np.array_equal(_emu_compact(x, hi, lo, k, check=False),
                          co.compact_indices_torch(x.abs().float(), thr, k).numpy())


@pytest.mark.parametrize("hi,lo,k", [(0.5, 0.1, 7), (3.5, 3.0, 40), (10.0, 9.0, 5)])
def test_emulated_unchecked_compaction_matches_reference_out_of_contract(hi, lo, k):
    """Brackets that break count_hi <= k <= count_hi + count_band: kernel and reference still agree
    (first k entries >= hi; slots nobody fills hold index 0)."""
    x = _data(20_000, 41)
    got = co.compact_indices_torch(x.abs(), torch.tensor([hi, lo]), k)
    assert np.array_equal(_emu_compact(x, hi, lo, k, check=False), got.numpy())


def _emu_mtc(a: np.ndarray, ts: np.ndarray, grid: int, block: int = 256) -> np.ndarray:
    """threshold_count.cu: grid-stride blocks, binary search, per-block uint32 bins, flush, suffix sum."""
    m = ts.size
    i = np.arange(a.size)
    blk = (i // block) % grid                  # which block's grid-stride loop reads entry i
    lo, hi = np.zeros(a.size, np.int64), np.full(a.size, m, np.int64)
    with np.errstate(invalid="ignore"):
        while (lo < hi).any():
            act = lo < hi
            mid = (lo + hi) >> 1
            pred = ts[np.minimum(mid, m - 1)] <= a
            lo = np.where(act & pred, mid + 1, lo)
            hi = np.where(act & ~pred, mid, hi)
    shared = np.zeros((grid, m), np.uint32)
    hit = lo > 0
    np.add.at(shared, (blk[hit], lo[hit] - 1), 1)
    hist = shared.astype(np.uint64).sum(axis=0)
    return co._suffix_sum(torch.from_numpy(hist.astype(np.int64))).numpy()


def test_emulated_multi_threshold_count_matches_reference():
    x = _data(50_000, 7, torch.float16, levels=8).abs()
    x[::301] = float("nan")
    t = torch.tensor([2.0, 0.25, 0.25, float("nan"), 0.0, 5.0, 1.0, 0.125, 1e-3])
    ts, pos, nan = co._sorted_thresholds(x, t)
    a = x.float().numpy()
    counts = _emu_mtc(a, ts.numpy(), grid=7)
    assert np.array_equal(co._unsort(torch.from_numpy(counts), pos, nan).numpy(),
                          co.multi_threshold_count_torch(x, t).numpy())
    # slices of sorted thresholds (the >4096-threshold path) give exact counts on their own
    for s in range(0, ts.numel(), 3):
        assert np.array_equal(_emu_mtc(a, ts[s:s + 3].numpy(), grid=5), counts[s:s + 3])


def _emu_f2bf(f: np.ndarray) -> np.ndarray:
    """common.cuh lt_f2bf."""
    u = f.astype(np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[nan] = 0x7FC0
    return r


def test_emulated_bf16_rounding_matches_torch():
    rng = np.random.default_rng(1)
    f = np.concatenate([
        (rng.standard_normal(20000) * 10.0 ** rng.uniform(-30, 30, 20000)).astype(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45, -1e-40], np.float32),
        (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),  # exact ties
    ]).astype(np.float32)
    mine = _emu_f2bf(f)
    ref = torch.from_numpy(f).to(torch.bfloat16)
    nan = np.isnan(f)
    assert np.array_equal(mine[~nan], ref.view(torch.int16).numpy().view(np.uint16)[~nan])
    assert torch.isnan(torch.from_numpy(mine.view(np.int16)).view(torch.bfloat16)[torch.from_numpy(nan)]).all()


def _to_np32(t):
    return t.detach().float().reshape(-1).numpy().copy()


def _emu_block_sum(v: np.ndarray) -> np.float64:
    """common.cuh lt_block_sum over 256 threads: shuffle-down trees in each warp, then in warp 0."""
    def warp_tree(w):
        for d in (16, 8, 4, 2, 1):            # __shfl_down_sync: lanes past the end read their own value
            w = w + np.concatenate([w[..., d:], w[..., 32 - d:]], axis=-1)
        return w[..., 0]
    lane0 = warp_tree(v.astype(np.float64).reshape(8, 32))
    return warp_tree(np.concatenate([lane0, np.zeros(24)]))


def _emu_lars_trust(partials: np.ndarray, c0: int, c1: int, reads: list) -> np.ndarray:
    """fused_lars.cu lars_trust: thread i adds partials c0+i, c0+i+256, ... in fp64, then a block sum."""
    acc = np.zeros((256, 2))
    for q in range(c0, c1):
        acc[(q - c0) % 256] += partials[q]
        reads.append(q)
    return np.array([_emu_block_sum(acc[:, 0]), _emu_block_sum(acc[:, 1])])


def _emu_lars(ps, gs, bs, lrs, wds, adapt, first, momentum, tc, eps, nesterov):
    """fused_lars.cu driven by the real _lars_tables: chunk partials (lars_norms), one trust ratio per
    tensor from its partials (lars_trust), fp32 update (lars_update)."""
    meta, chunks = co._lars_tables(ps, gs, bs, adapt, first)
    by_ptr = {}
    for t in ps + gs + bs:
        by_ptr.setdefault(t.data_ptr(), t)
    f32 = np.float32
    partials = np.zeros((len(chunks), 2))
    for c, (t, start) in enumerate(chunks):
        p_ptr, g_ptr, _, n, codes, _, _, _ = meta[t]
        if not (codes >> 24) & 1:
            continue
        p, g = _to_np32(by_ptr[p_ptr]), _to_np32(by_ptr[g_ptr])
        end = min(start + co._LARS_CHUNK, n)
        for k, v in enumerate((p, g)):
            seg = np.zeros(-(-(end - start) // 256) * 256, f32)
            seg[: end - start] = v[start:end]
            acc = np.zeros(256, f32)           # per-thread fp32 sums, strided like the kernel loop
            for row in seg.reshape(-1, 256):
                acc = acc + row * row
            partials[c, k] = _emu_block_sum(acc)
    reads: list = []
    out_p, out_b = [], []
    for t, (p_ptr, g_ptr, b_ptr, _n, codes, c0, c1, _) in enumerate(meta):
        flags = codes >> 24
        p, g, b = _to_np32(by_ptr[p_ptr]), _to_np32(by_ptr[g_ptr]), _to_np32(by_ptr[b_ptr])
        lr, wd = f32(lrs[t]), f32(wds[t])
        if flags & 1:
            sp, sg = _emu_lars_trust(partials, c0, c1, reads)
            w, gn = f32(np.sqrt(sp)), f32(np.sqrt(sg))
            trust = f32(1) if (w == 0 or gn == 0) else f32(tc) * w / (gn + wd * w + f32(eps))
            d = trust * (g + wd * p)
        else:
            d = g
        nb = d if flags & 2 else f32(momentum) * b + d
        upd = d + f32(momentum) * nb if nesterov else nb
        out_p.append(p - lr * upd)
        out_b.append(nb)
    # every chunk partial is read once in all (the earlier kernel re-read a tensor's partials per chunk)
    assert sorted(reads) == [c for c, (t, _) in enumerate(chunks) if adapt[t]]
    return out_p, out_b


def test_emulated_block_sum_and_trust_reduction():
    v = np.random.default_rng(2).standard_normal(256) * 1e3
    assert np.isclose(_emu_block_sum(v), v.sum(), rtol=1e-13)
    partials = np.random.default_rng(3).random((5000, 2))      # a 80M-entry tensor has ~5000 chunks
    reads: list = []
    got = _emu_lars_trust(partials, 100, 4900, reads)
    assert reads == list(range(100, 4900))
    assert np.allclose(got, partials[100:4900].sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
def test_emulated_fused_lars_matches_reference(nesterov):
    shapes, ps, bufs, adapt, lrs, wds = _lars_problem(8)
    ps.append(torch.randn(40_000, generator=_gen(9)))  # several chunks for one tensor
    bufs.append(torch.randn(40_000, generator=_gen(10)))
    adapt.append(True), lrs.append(0.1), wds.append(1e-4)
    gs = _grads(shapes, 1, torch.float32) + [torch.randn(40_000, generator=_gen(11))]
    first = [False] * len(ps)
    first[1] = True
    meta, chunks = co._lars_tables(ps, gs, bufs, adapt, first)
    assert len(chunks) == sum(-(-p.numel() // co._LARS_CHUNK) for p in ps)
    assert meta[-1][6] - meta[-1][5] == 3 and meta[4][5] == meta[4][6]     # 40k -> 3 chunks; empty -> none
    emu_p, emu_b = _emu_lars(ps, gs, bufs, lrs, wds, adapt, first, 0.9, 0.001, 1e-8, nesterov)
    co.fused_lars_step_torch(ps, gs, bufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, nesterov, first)
    for e, p in zip(emu_p + emu_b, ps + bufs):
        assert np.allclose(e, _to_np32(p), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- GPU (CUDA + CuPy only)
gpu = pytest.mark.gpu  # skipped without CUDA + CuPy (tests/conftest.py)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_multi_threshold_count_and_compaction(dtype):
    x = _data(1_000_003, 12, dtype, levels=64)
    t = torch.linspace(0, 3, 5000)
    assert torch.equal(co.multi_threshold_count(x.abs().cuda(), t.cuda()).cpu(), co.multi_threshold_count_torch(x.abs(), t))
    k = 10_000
    hi, lo = _brackets(x, k)
    v, i = co.compact_selected(x.cuda(), hi, lo, k)
    rv, ri = co.compact_selected_torch(x, hi, lo, k)
    assert torch.equal(i.cpu(), ri) and torch.equal(v.cpu(), rv)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_sync_free_count_and_compaction(dtype):
    """multi_threshold_count and compact_indices on CUDA: the references' results, and CUDA's sync
    detector sees no device-to-host synchronisation."""
    x = _data(1_000_003, 16, dtype, levels=64)
    a, k = x.abs(), 10_000
    hi, lo = _brackets(x, k)
    t, thr = torch.linspace(0, 3, 300), torch.tensor([hi, lo])
    ac, tc, thrc = a.cuda(), t.cuda(), thr.cuda()
    co.multi_threshold_count(ac, tc), co.compact_indices(ac, thrc, k)     # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts, idx = co.multi_threshold_count(ac, tc), co.compact_indices(ac, thrc, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(counts.cpu(), co.multi_threshold_count_torch(a, t))
    assert torch.equal(idx.cpu(), co.compact_indices_torch(a, thr, k))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_gpu_scatter_add(dtype):
    g = _gen(13)
    vals = torch.randn(40_000, generator=g).to(dtype)
    idx = torch.randint(0, 5000, (40_000,), generator=g, dtype=torch.int32)
    got = co.scatter_add_dense(torch.zeros(5000, dtype=dtype, device="cuda"), vals.cuda(), idx.cuda(), 0.5)
    ref = co.scatter_add_dense_torch(torch.zeros(5000, dtype=dtype), vals, idx, 0.5)
    tol = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 0.1, torch.bfloat16: 0.5}[dtype]
    assert torch.allclose(got.cpu().double(), ref.double(), atol=tol, rtol=0)
    if dtype == torch.float32:  # a bad index fails a device-side assertion, fatal for the CUDA context: in a child
        code = ("import torch\nfrom lightning_topk.ops import cuda as co\n"
                "co.scatter_add_dense(torch.zeros(4, device='cuda'), torch.ones(1, device='cuda'), "
                "torch.tensor([9], dtype=torch.int32, device='cuda'))\ntorch.cuda.synchronize()\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "assert" in r.stderr.lower(), r.stderr


@gpu
@pytest.mark.parametrize("pdtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_fused_lars(pdtype):
    shapes, ps, bufs, adapt, lrs, wds = _lars_problem(14, pdtype)
    cps, cbufs = [p.cuda() for p in ps], [b.cuda() for b in bufs]
    cgs = [torch.empty(s, dtype=pdtype, device="cuda") for s in shapes]   # gradients stay where they are
    for step in range(5):
        gs = _grads(shapes, step, pdtype)
        torch._foreach_copy_(cgs, [g.cuda() for g in gs])
        torch.cuda.synchronize()
        # from step 2 the device tables are cached: no host synchronisation at all
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
        try:
            co.fused_lars_step(cps, cgs, cbufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, True, step == 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        co.fused_lars_step_torch(ps, gs, bufs, lrs, wds, adapt, 0.9, 0.001, 1e-8, True, step == 0)
    rtol = 1e-5 if pdtype == torch.float32 else 2 ** -7
    for a, b in zip(cps + cbufs, ps + bufs):
        assert torch.allclose(a.cpu().float(), b.float(), rtol=rtol, atol=1e-6)


def test_dlpack_view_is_zero_copy_and_16bit_floats_travel_as_int16():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(8, requires_grad=True).to(dt)
        v = co._dlpack_view(t)
        arr = np.from_dlpack(v)               # the same protocol CuPy uses, on CPU
        assert arr.dtype == (np.int16 if dt != torch.float32 else np.float32)
        assert arr.__array_interface__["data"][0] == t.data_ptr()   # no copy
        with torch.no_grad():
            t[0] = 2.0
        assert torch.equal(torch.from_numpy(arr.copy()).view(dt)[0], torch.tensor(2.0, dtype=dt))
