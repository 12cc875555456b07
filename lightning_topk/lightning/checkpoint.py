"""Per-rank checkpoint shards of the top-k compression state (residuals, momentum-correction velocities).

Layout, beside the Lightning checkpoint ``<dir>/<name>`` (which rank 0 writes)::

    <dir>/<name>                           Lightning's file; ``checkpoint["lightning_topk"]`` holds what is
                                           the same on every rank: format version, save key, world size,
                                           node layout, step, whether that step sent sparse (recipe="auto"
                                           engages after one), config, parameter name -> numel, and the
                                           sections of exchanges whose state is rank-independent
                                           (``exchanges``: exchange="auto"'s plan and cost model), so every
                                           rank restores one plan whatever its shard holds
    <dir>/.topk-shards/<name>/rank{r}.pt   rank r's residuals and velocities keyed by parameter name and its
                                           per-rank exchange sections (``exchanges``: the scale-free
                                           exchanges' owner residuals) (plain CPU tensors and JSON types:
                                           loaded with ``torch.load(weights_only=True)``)

Format version 2 keeps one section per exchange (:meth:`Exchange.state_dict
<lightning_topk.comm.exchanges.base.Exchange.state_dict>`); version 1 files (owner residuals and
``auto``'s plan at the top level) are still read and converted.

The shards live in one hidden folder per checkpoint directory, not beside the checkpoint under a name
that starts with the checkpoint's: Lightning's SLURM requeue names its checkpoint ``hpc_ckpt_<N+1>``
after counting every entry of the folder that contains ``hpc_ckpt_``, so a ``hpc_ckpt_1.ckpt.topk``
folder (the layout before this one) counted as a checkpoint. Checkpoints written with that older layout,
``<dir>/<name>.topk/rank{r}.pt``, are still read (and removed with their checkpoint).

Every rank writes its own shard atomically (:mod:`lightning_topk.files`) before rank 0 writes the
main file. Remote checkpoints (``s3://``, ``gs://``, any fsspec URL, as Lightning's own checkpoint I/O
takes) get their shards beside them through fsspec, and are read, checked and removed the same way; no
collective is used, so saving works from any point where Lightning saves. The shard carries the save key
of the main file, so a stale shard (a rank that died before overwriting
``.topk-shards/last.ckpt/rank1.pt``) is detected on load instead of being used silently.

Restore rules (:func:`restore_rank_state`), decided identically on every rank, with at most one
warning (from rank 0) that says what was redistributed or reset:

* same world size: rank r gets shard r exactly (also when the node layout or the flat/hierarchical
  exchange changed: both apply ``(1/W) * sum_r residual_r`` as the pending update); exchange="auto"'s
  plan and model come from the main file on every rank, also where a rank's shard is missing or stale,
  so no rank ever issues other collectives than the rest;
* different world size W -> W': every new rank gets the average ``(1/W) * sum_r residual_r`` (and the
  same for velocities), after each shard's owner residuals were folded into its residuals (same
  pending update, see :mod:`lightning_topk.comm.exchanges.scatter`); the choices of exchange="auto" are dropped. The pending update of error feedback is ``(1/W) * sum_r residual_r``; with
  W' copies of the average it is ``(1/W') * W' * avg``, i.e. unchanged;
* a checkpoint without top-k state (plain ``ddp``, weights-only) or with missing/corrupt/stale shards:
  the affected residuals start at zero; the density schedule continues at the saved step (or the
  checkpoint's ``global_step``);
* sparse local SGD (``local_steps`` > 0) saved and resumed in another layout (world size, nodes, processes per
  node) or with another ``outer_chunk``: the outer state is resharded from every saved rank's section
  (:func:`lightning_topk.comm.local.checkpoint.reshard`: θ_outer and outer momentum carried, error feedback averaged
  over the saved replicas like residuals, each new replica takes a saved replica's θ_local and inner
  optimizer state, every new rank the average of the saved ranks' module buffers); a missing or unusable
  shard then fails with a message naming it;
* residuals of parameters the model no longer has (or whose size changed) are dropped; velocities
  are dropped when ``momentum_correction`` is now off (with ``recipe="auto"``: once the optimizer shows
  it stays off), everything when ``error_feedback`` is off.
"""
from __future__ import annotations

import os
import posixpath
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from lightning_topk.comm.exchanges import registry
from lightning_topk.comm.local import AUTO_EXCHANGE_INPUTS, outer_exchange_for, reshard, shard_layout
from lightning_topk.comm.state import upgrade_sections
from lightning_topk.files import atomic_torch_save, is_url, isdir, isfile, join, local_path, open_read, remove

FORMAT = "lightning_topk.rank_state"
VERSION = 2
READABLE = (1, 2)  # versions this build loads (1: converted, see TopKState.load_state_dict)
META_KEY = "lightning_topk"
SHARD_FOLDER = ".topk-shards"  # <dir>/.topk-shards/<checkpoint name>/rank{r}.pt
SHARD_SUFFIX = ".topk"  # the layout before: <dir>/<checkpoint name>.topk/rank{r}.pt (still read and removed)
KINDS = ("residual", "velocity")


def _split(ckpt_path) -> Tuple[str, str]:
    """(directory, file name) of a local path or URL."""
    p = os.fspath(ckpt_path)
    if is_url(p):
        d, _, name = p.rstrip("/").rpartition("/")
        return d, name
    return os.path.split(p)


def shard_dir(ckpt_path) -> str:
    """Where the shards of ``ckpt_path`` are written: ``<dir>/.topk-shards/<name>``."""
    d, name = _split(ckpt_path)
    return join(d, SHARD_FOLDER, name) if d else join(SHARD_FOLDER, name)


def legacy_shard_dir(ckpt_path) -> str:
    """The shard directory of the older layout, ``<ckpt>.topk`` (read and removed, never written)."""
    return os.fspath(ckpt_path) + SHARD_SUFFIX


def shard_path(ckpt_path, rank: int) -> str:
    return join(shard_dir(ckpt_path), f"rank{int(rank)}.pt")


def _rank_zero_warn(msg: str) -> None:
    from pytorch_lightning.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(msg)


def layout_of(strategy) -> Dict[str, Any]:
    state = strategy.topk_state
    return {
        "world_size": int(strategy.world_size),
        "num_nodes": int(strategy.num_nodes),
        "local_world_size": int(strategy.num_processes),
        "hierarchical": bool(state is not None and state.groups is not None),
    }


def _param_numels(module) -> Dict[str, int]:
    return {n: int(p.numel()) for n, p in module.named_parameters() if p.requires_grad}


def save_key(checkpoint: Dict[str, Any], step: int) -> str:
    """Same on every rank without communication; changes whenever training advanced."""
    return f"epoch{checkpoint.get('epoch', -1)}-gs{checkpoint.get('global_step', -1)}-ex{step}"


# ---- save ---------------------------------------------------------------------------------------
def save_rank_state(strategy, checkpoint: Dict[str, Any], filepath) -> None:
    """Write this rank's shard and put the metadata into ``checkpoint`` (rank 0 writes that file)."""
    state = strategy.topk_state
    if state is None or "optimizer_states" not in checkpoint:
        return  # nothing exchanged yet, or a weights-only checkpoint (not a resume point)
    sd = state.state_dict()
    key = save_key(checkpoint, int(sd["step"]))
    meta = dict(
        format=FORMAT, version=VERSION, save_key=key, name=os.path.basename(os.fspath(filepath)),
        step=int(sd["step"]), global_step=int(checkpoint.get("global_step", -1)), last_sparse=bool(sd["last_sparse"]),
        config=asdict(state.config), numels=_param_numels(strategy.lightning_module),
        exchanges={n: v for n, v in sd["exchanges"].items() if _shared(n)}, **layout_of(strategy),
    )
    checkpoint[META_KEY] = meta
    shard = dict(format=FORMAT, version=VERSION, save_key=key, rank=int(strategy.global_rank),
                 world_size=meta["world_size"], residual=sd["residual"], velocity=sd["velocity"],
                 exchanges={n: v for n, v in sd["exchanges"].items() if not _shared(n)})
    atomic_torch_save(shard, shard_path(filepath, strategy.global_rank))


def _shared(name: str) -> bool:
    """Whether exchange ``name`` keeps a rank-independent section (saved once, in the main file)."""
    try:
        return bool(registry.get(name).shared_state)
    except ValueError:  # an exchange registered in the run that saved, not in this one: keep it per rank
        return False


def remove_rank_state(strategy, filepath) -> None:
    """Remove this rank's shard; global rank 0 also removes the shard directory (either layout)."""
    remove(shard_path(filepath, strategy.global_rank))
    if strategy.is_global_zero:
        remove(shard_dir(filepath), recursive=True)
        remove(legacy_shard_dir(filepath), recursive=True)


# ---- load ---------------------------------------------------------------------------------------
def find_shard_dir(ckpt_path, meta: Dict[str, Any]) -> Optional[str]:
    """The shard directory of a checkpoint: beside it, beside its symlink target, or by saved name; in the
    current layout (``.topk-shards/<name>``) first, then in the older one (``<name>.topk``)."""
    url = is_url(ckpt_path)
    path = os.fspath(ckpt_path) if url else local_path(ckpt_path)
    files = [path] if url else [path, os.path.realpath(path)]
    name = meta.get("name")
    # The saved name only ever selects a sibling: no separators, no '..' (cannot leave the directory).
    if isinstance(name, str) and name and os.path.basename(name) == name and name not in (".", ".."):
        files.append(join((posixpath if url else os.path).dirname(path), name))
    for c in [shard_dir(f) for f in files] + [legacy_shard_dir(f) for f in files]:
        if isdir(c):
            return c
    return None


def read_shard(path: str, meta: Dict[str, Any], rank: int, mmap: bool = False) -> Tuple[Optional[dict], str]:
    """Load and check one shard; returns (shard, "") or (None, reason)."""
    if not isfile(path):
        return None, "missing"
    try:
        if is_url(path):
            with open_read(path) as f:
                shard = torch.load(f, map_location="cpu", weights_only=True)
        else:
            shard = torch.load(local_path(path), map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # corrupt, truncated, or not a weights-only file
        return None, f"unreadable ({type(e).__name__})"
    if not isinstance(shard, dict) or shard.get("format") != FORMAT:
        return None, "not a lightning_topk shard"
    if shard.get("version") not in READABLE:
        return None, f"format version {shard.get('version')!r} (this build reads {list(READABLE)})"
    if shard.get("save_key") != meta.get("save_key"):
        return None, f"stale (saved at {shard.get('save_key')}, checkpoint is {meta.get('save_key')})"
    if shard.get("rank") != rank or shard.get("world_size") != meta.get("world_size"):
        return None, "rank/world size do not match the checkpoint"
    for kind in KINDS:
        d = shard.get(kind, {})
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in d.items()):
            return None, f"malformed {kind} entries"
    for kind, typ in (("owner_residual", Tensor), ("plan", str)):  # version 1
        d = shard.get(kind, {})
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, typ) for k, v in d.items()):
            return None, f"malformed {kind} entries"
    ex = shard.get("exchanges", {})
    if not isinstance(ex, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in ex.items()):
        return None, "malformed exchange sections"
    return shard, ""


def _average(shards: List[dict], kind: str, world: int) -> Dict[str, Tensor]:
    names: List[str] = []
    for s in shards:
        names += [n for n in s[kind] if n not in names]
    out = {}
    for n in names:
        acc = None
        for s in shards:  # fixed order: every rank computes bit-identical averages
            t = s[kind].get(n)
            if t is None:
                continue
            t = t.to(torch.float64)
            acc = t.clone() if acc is None else acc.add_(t)
        out[n] = acc.div_(world).to(torch.float32)
    return out


def _is_fitting(strategy) -> bool:
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return trainer is None or getattr(fn, "value", fn) == "fit"


def restore_rank_state(strategy, ckpt_path, checkpoint: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This rank's state for :meth:`TopKState.load_state_dict`, following the module docstring's rules."""
    if not _is_fitting(strategy):
        return None  # validate/test/predict from a checkpoint: no exchange will run
    cfg = strategy.topk_config
    rank, world = int(strategy.global_rank), int(strategy.world_size)
    meta = checkpoint.get(META_KEY)
    notes: List[str] = []
    empty = {kind: {} for kind in KINDS}
    gstep = int(checkpoint.get("global_step", 0) or 0)

    def done(step: int, tensors: Dict[str, Dict[str, Tensor]], extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        tensors = _fit_to_model(strategy, tensors, notes)
        if notes:
            _rank_zero_warn("lightning_topk: restoring top-k compression state from "
                            f"{os.fspath(ckpt_path)!r}: " + "; ".join(notes))
        sections = dict((extra or {}).get("exchanges", {}))
        if not cfg.error_feedback:  # owner residuals are error feedback too
            sections = {n: v for n, v in sections.items() if "owner_residual" not in v}
        # recipe="auto" engages after a step that sent sparse: a resume right after one engages as the run would have
        last_sparse = isinstance(meta, dict) and meta.get("format") == FORMAT and bool(meta.get("last_sparse"))
        return {"step": step, **tensors, "exchanges": sections, "last_sparse": last_sparse}

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        if not cfg.error_feedback:
            return done(gstep, empty)
        notes.append("the checkpoint has no top-k state (written by another strategy such as plain 'ddp', "
                     "or weights-only), so every rank's residuals start at zero and the density schedule "
                     f"continues at step {gstep} (the checkpoint's global_step)")
        return done(gstep, empty)
    step = int(meta.get("step", gstep))
    same_world = int(meta.get("world_size", 0)) == world
    if meta.get("version") not in READABLE:
        notes.append(f"top-k state format version {meta.get('version')!r} is not readable by this build "
                     f"(versions {list(READABLE)}); residuals reset to zero")
        return done(step, empty)
    # Rank-independent sections (exchange="auto"'s plan and model) come from the main file, the same for
    # every rank, never from a shard; with another world size they no longer apply.
    shared = upgrade_sections(meta) if same_world else {}
    plan_only = {"exchanges": shared}
    old_world = int(meta.get("world_size", 0))
    sdir = find_shard_dir(ckpt_path, meta)
    if sdir is None:
        notes.append(f"shard directory {shard_dir(ckpt_path)!r} not found; residuals of all ranks reset to zero")
        return done(step, empty, plan_only)
    if _local_reshard(cfg, meta, strategy):
        return done(step, empty, {"exchanges": {"local": _resharded_local(strategy, sdir, meta)}})
    if old_world == world and _both_local(cfg, meta):
        _agree_on_local_shards(strategy, sdir, meta)  # raises on every rank alike unless all are usable
    if old_world == world:
        # Everyone checks every shard's header (cheap with mmap) so all ranks take the same decision.
        bad = {r: why for r in range(old_world)
               for _, why in [read_shard(join(sdir, f"rank{r}.pt"), meta, r, mmap=True)] if why}
        if bad:
            notes.append("shards not usable: " + ", ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
                         + "; those ranks' residuals reset to zero, the other ranks keep theirs")
        if rank in bad:
            return done(step, empty, plan_only)
        shard, _ = read_shard(join(sdir, f"rank{rank}.pt"), meta, rank)
        # Same world size: per-rank residuals stay valid for any node layout (see module docstring).
        return done(step, {kind: dict(shard[kind]) for kind in KINDS},
                    {"exchanges": {**upgrade_sections(shard), **shared}})
    shards, bad = [], {}
    for r in range(old_world):
        s, why = read_shard(join(sdir, f"rank{r}.pt"), meta, r, mmap=True)
        if why:
            bad[r] = why
        else:
            shards.append(s)
    if bad or not shards:
        notes.append(f"world size changed from {old_world} to {world} and shards are not usable ("
                     + ", ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
                     + "); residuals of all ranks reset to zero")
        return done(step, empty)
    for s in shards:
        _fold_owner(s)
    tensors = {kind: _average(shards, kind, old_world) for kind in KINDS}
    notes.append(f"world size changed from {old_world} to {world}: every rank starts from the average of "
                 f"the {old_world} saved ranks' residuals" + (" and velocities" if tensors["velocity"] else "")
                 + ", which keeps the pending update (1/W)*sum(residuals) unchanged")
    return done(step, tensors)


def _both_local(cfg, meta: Dict[str, Any]) -> bool:
    """Sparse local SGD saved and resumed."""
    saved = meta.get("config") or {}
    return cfg.local_steps > 0 and int(saved.get("local_steps", 0) or 0) > 0


def _agree_on_local_shards(strategy, sdir: str, meta: Dict[str, Any]) -> None:
    """Sparse local SGD resumed at the saved world size: every rank must restore its own outer state from this
    checkpoint, or the ranks would enter the outer rounds at different positions (a rank starting afresh at 0
    while the others go on: misaligned collectives, a hang, or replicas drifting apart). Each rank reads its own
    shard; one ``all_gather_object`` over every rank (so a shard only its own node can see counts too) brings
    every verdict and every section's (position, steps) to every rank, and all raise the same ``ValueError``
    naming each missing or stale rank and file when any is unusable or they disagree."""
    import torch.distributed as dist

    rank, world = int(strategy.global_rank), int(strategy.world_size)

    def verdict(r: int) -> Tuple[str, Optional[List[int]]]:
        shard, why = read_shard(join(sdir, f"rank{r}.pt"), meta, r, mmap=True)
        section = upgrade_sections(shard).get("local") if shard is not None else None
        if shard is not None and not section:
            why = "no local SGD section"
        return why, None if why else [int(section.get("position", -1)), int(section.get("steps", -1))]

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world > 1:
        mine: List[Any] = [verdict(rank)]
        every: List[Any] = [None] * world
        dist.all_gather_object(every, mine[0])
    else:  # no process group (yet): every shard is read here
        every = [verdict(r) for r in range(world)]
    bad = {r: why for r, (why, _) in enumerate(every) if why}
    where = {tuple(pos) for why, pos in every if not why}
    if bad:
        raise ValueError("topk_local: cannot resume local SGD: the outer state of "
                         + ", ".join(f"rank {r} ({join(sdir, f'rank{r}.pt')}: {w})" for r, w in sorted(bad.items()))
                         + " is not usable, and every rank must restore its own from this checkpoint (a rank "
                         "starting its outer rounds afresh would misalign them with the other ranks'). Restore "
                         "the shard file(s), or resume from a checkpoint whose shards are all present")
    if len(where) > 1:
        raise ValueError("topk_local: cannot resume local SGD: the ranks' saved outer states are at different "
                         "(position, steps): " + ", ".join(f"rank {r}: {tuple(p)}" for r, (_, p) in enumerate(every))
                         + f" in {sdir!r} (shards of different checkpoints); resume from one checkpoint")


def _local_reshard(cfg, meta: Dict[str, Any], strategy) -> bool:
    """Sparse local SGD saved and resumed, in another layout (world size, nodes, processes per node) or with
    another ``outer_chunk``, or with options that resolve to another outer exchange (:func:`outer_exchange_for
    <lightning_topk.comm.local.exchanges.outer_exchange_for>` of the saved and the new options on this layout: the same
    exchange spelled ``"auto"`` and pinned is no change): the outer state is resharded
    (:func:`lightning_topk.comm.local.checkpoint.reshard`; it folds the scale-free exchange's owner buffers into ``ef``)."""
    saved = meta.get("config") or {}
    if cfg.local_steps <= 0 or int(saved.get("local_steps", 0) or 0) <= 0:
        return False
    if (int(meta.get("world_size", 0)) != int(strategy.world_size)
            or int(meta.get("num_nodes", 0)) != int(strategy.num_nodes)
            or int(meta.get("local_world_size", 0)) != int(strategy.num_processes)
            or saved.get("outer_chunk") != cfg.outer_chunk):
        return True
    # Same layout: only the exchange it resolves to matters (an "auto" that resolved to "scatter" resumed with
    # "scatter" pinned is the same run), not its spelling or the options "auto" reads.
    n = sum(_param_numels(strategy.lightning_module).values())
    replicas, local = int(strategy.num_nodes), int(strategy.num_processes)
    old = SimpleNamespace(**{**asdict(cfg), **{k: v for k, v in saved.items() if k in AUTO_EXCHANGE_INPUTS
                                                 or k in ("outer_exchange", "outer_chunk")}})
    old.outer_exchange = saved.get("outer_exchange", "auto")
    return (outer_exchange_for(old, replicas, shard_layout(old, n, local))
            != outer_exchange_for(cfg, replicas, shard_layout(cfg, n, local)))


def _resharded_local(strategy, sdir: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's ``local`` section resharded from every saved rank's (the same on every rank of a replica);
    raises ``ValueError`` naming what is missing (every rank reads every shard, so all raise alike)."""
    old_world, old_local = int(meta.get("world_size", 0)), int(meta.get("local_world_size", 1) or 1)
    where = (f"{old_world} ranks ({meta.get('num_nodes')} nodes x {old_local}) to {strategy.world_size} "
             f"({strategy.num_nodes} x {strategy.num_processes})")
    sections, bad = [], {}
    for r in range(old_world):
        shard, why = read_shard(join(sdir, f"rank{r}.pt"), meta, r, mmap=True)
        section = upgrade_sections(shard).get("local") if shard is not None else None
        if shard is not None and not section:
            why = "no local SGD section"
        if why:
            bad[r] = why
        else:
            sections.append(section)
    if bad:
        raise ValueError("topk_local: cannot reshard the outer state (theta_outer, outer momentum, error feedback) "
                         f"from {where}: shards not usable (" + ", ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
                         + "); resume with the saved layout, or from a checkpoint whose shards are all present")
    out = reshard(sections, old_local, int(strategy.global_rank) // max(1, int(strategy.num_processes)))
    _rank_zero_warn(f"lightning_topk: topk_local resharded the outer state from {where}: theta_outer and the outer "
                    "momentum carried over, each replica's error feedback is the average of the saved replicas', "
                    "each replica continues the round from a saved replica's weights and inner optimizer state, "
                    "every rank from the average of the saved ranks' module buffers (BatchNorm statistics)")
    return out


def _fold_owner(shard: dict) -> None:
    """Owner residuals (the scale-free exchanges' sections) into the shard's own residuals: same pending
    update."""
    from lightning_topk.comm.exchanges.scatter import fold_owner_residual

    res = shard["residual"] = dict(shard["residual"])
    for section in upgrade_sections(shard).values():
        for key, t in dict(section.get("owner_residual", {})).items():
            for name, v in fold_owner_residual(key, t).items():
                res[name] = v if name not in res else res[name].float() + v


def _fit_to_model(strategy, tensors: Dict[str, Dict[str, Tensor]], notes: List[str]) -> Dict[str, Dict[str, Tensor]]:
    """Drop entries the current model/config cannot take, and say so."""
    cfg = strategy.topk_config
    if not cfg.error_feedback:
        if any(tensors[k] for k in KINDS):
            notes.append("error_feedback is off: saved residuals and velocities were discarded")
        return {kind: {} for kind in KINDS}
    # recipe="auto" may turn momentum correction on once the optimizer is known (after this load): the
    # strategy drops the velocities then if it does not.
    if not cfg.momentum_correction and cfg.recipe != "auto" and tensors["velocity"]:
        notes.append("momentum_correction is off: saved momentum-correction velocities were discarded "
                     "(residuals kept)")
        tensors = {"residual": tensors["residual"], "velocity": {}}
    elif cfg.momentum_correction and tensors["residual"] and not tensors["velocity"]:
        notes.append("momentum_correction is on but the checkpoint has no velocities: they start at zero")
    numels = _param_numels(strategy.lightning_module)
    out: Dict[str, Dict[str, Tensor]] = {}
    dropped: List[str] = []
    for kind in KINDS:
        out[kind] = {}
        for name, t in tensors[kind].items():
            if numels.get(name) == t.numel():
                out[kind][name] = t
            elif name not in dropped:
                dropped.append(name)
    if dropped:
        notes.append(f"dropped saved state of {len(dropped)} parameter(s) the model does not have with that "
                     f"size: {dropped[:5]}")
    return out
