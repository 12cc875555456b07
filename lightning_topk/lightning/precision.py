"""``TopKPrecision``: a Lightning precision plugin for fp16/bf16 autocast that is safe with top-k exchange.

Differences from Lightning's ``MixedPrecision`` (whose hooks it follows):

* gradient clipping works with fused optimizers: gradients are always unscaled (``scaler.unscale_``) before
  the clipping hook, then ``scaler.step`` runs the (fused) step, which sees them already unscaled;
* the overflow decision is global: after unscaling, the found-inf flag goes into the one per-step reduction
  of the ``topk_ddp`` strategy's step controller (or, under any other strategy, its own all-reduce), so one
  rank's overflow skips the step everywhere, the residuals are rolled back, and the scale stays identical on
  every rank (the strategy hands the live scale to the hooks, so residuals stay in unscaled units);
* optional fp32 master weights for models whose parameters are fp16/bf16;
* plain torch SGD/Adam/AdamW built without an explicit ``fused``/``foreach`` choice are switched to
  their fused form;
* the state is checkpointed under the fixed key :data:`STATE_KEY`, not the class name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

import torch
import torch.distributed as dist
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_topk.comm.controller import Decision

STATE_KEY = "lightning_topk.TopKPrecision"
PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
_LOW = (torch.float16, torch.bfloat16)
_FUSABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class TopKPrecisionMixin:
    """The logic of :class:`TopKPrecision`, shared with ``lightning.pytorch``'s
    :class:`~lightning_topk.lightning.unified.UnifiedTopKPrecision` (two packages, two Precision bases).

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + dynamic loss scaling), ``"bf16-mixed"`` (bf16 autocast,
            no scaler) or ``"32-true"``.
        device: device type for autocast and the scaler (``"cpu"``, ``"cuda"``, ...); ``None``: ``"cuda"``
            when available, else ``"cpu"``.
        init_scale, growth_factor, backoff_factor, growth_interval: ``torch.amp.GradScaler`` settings
            (``"16-mixed"`` only).
        master_weights: keep fp32 copies of fp16/bf16 parameters in the optimizer; gradients are copied to
            them after backward and the updated values copied back to the model after each applied step.
        fused_optimizers: switch torch SGD/Adam/AdamW that were built with ``fused=None, foreach=None``
            to ``fused=True`` when connecting.
    """

    def __init__(self, precision: str = "16-mixed", device: Optional[str] = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 master_weights: bool = False, fused_optimizers: bool = True) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"TopKPrecision: option 'precision' must be one of {PRECISIONS}, got {precision!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device_type = torch.device(device).type
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"TopKPrecision: option 'device' must be a device type such as 'cpu' or 'cuda', "
                             f"got {device!r}") from err
        _check("init_scale", init_scale, lambda v: v > 0, "> 0")
        _check("growth_factor", growth_factor, lambda v: v > 1, "> 1")
        _check("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"TopKPrecision: option 'growth_interval' must be an int >= 1, got {growth_interval!r}")
        for name, v in (("master_weights", master_weights), ("fused_optimizers", fused_optimizers)):
            if not isinstance(v, bool):
                raise ValueError(f"TopKPrecision: option '{name}' must be True or False, got {v!r}")
        self.precision = precision
        self.device = device_type
        self.master_weights = master_weights
        self.fused_optimizers = fused_optimizers
        self.scaler: Optional[torch.amp.GradScaler] = None
        if precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_factor=growth_factor,
                                               backoff_factor=backoff_factor, growth_interval=growth_interval)
        # id(optimizer) -> [(model param, fp32 master)]
        self._masters: Dict[int, List[Tuple[Tensor, Tensor]]] = {}
        self._pending_masters: Optional[List[Tensor]] = None
        self.skipped_steps = 0
        self.last_step_skipped = False

    @property
    def finishes_topk_step(self) -> bool:
        """With a loss scaler this plugin hands the step's found-inf to the top-k step controller itself,
        after unscaling; the strategy then leaves the decision to it."""
        return self.scaler is not None

    # ---- setup -------------------------------------------------------------------------------------------
    @override
    def connect(self, model: torch.nn.Module, optimizers: List[Optimizer], lr_schedulers: List[Any]):
        if self.master_weights:
            for opt in optimizers:
                self._make_masters(opt)
        if self.scaler is not None:
            fp16 = [p for opt in optimizers for g in opt.param_groups for p in g["params"]
                    if p.dtype == torch.float16]
            if fp16:
                raise ValueError("TopKPrecision: precision='16-mixed' with fp16 parameters in the optimizer needs "
                                 "option 'master_weights'=True (GradScaler cannot unscale fp16 gradients)")
        if self.fused_optimizers:
            for opt in optimizers:
                _prefer_fused(opt)
        return model, optimizers, lr_schedulers

    def _make_masters(self, opt: Optimizer) -> None:
        pairs = []
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype in _LOW:
                    m = p.detach().clone().float().requires_grad_(True)
                    group["params"][i] = m
                    if p in opt.state:
                        opt.state[m] = opt.state.pop(p)
                    pairs.append((p, m))
        self._masters[id(opt)] = pairs
        if self._pending_masters is not None:
            self._load_masters(self._pending_masters)

    # ---- forward / backward ------------------------------------------------------------------------------
    @override
    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager():
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    # ---- optimizer step ----------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None and not self._masters.get(id(optimizer)):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("TopKPrecision: LBFGS works only with precision='bf16-mixed'/'32-true' and "
                             "master_weights=False")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        skipped = False
        if not skip_unscaling:
            self._grads_to_masters(optimizer)
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)  # before clipping, for every optimizer (fused ones too)
                skipped = self._global_skip(optimizer, model)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        if self.scaler is None:
            out = optimizer.step(**kwargs)
            self._masters_to_model(optimizer)
            return out
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self.last_step_skipped = skipped
        self.skipped_steps += int(skipped)
        if not skipped:
            self._masters_to_model(optimizer)
        return out

    def _global_skip(self, optimizer: Optimizer, model: Any) -> bool:
        """One reduction of the found-inf flags over all ranks, written back so that the scaler skips on every
        rank alike; under ``topk_ddp`` it is the step controller's reduction (which also rolls back)."""
        found = list(self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        ctl = _topk_controller(model)
        if ctl is not None:
            return ctl.finish_step(model.named_parameters(), found_inf=found) is Decision.SKIP
        dev = found[0].device if found else torch.device(self.device)
        flag = torch.zeros((), dtype=torch.float32, device=dev)
        for t in found:
            flag += t.to(dev)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for t in found:
            t.copy_(flag)
        return bool(flag > 0)

    def _grads_to_masters(self, optimizer: Optimizer) -> None:
        for p, m in self._masters.get(id(optimizer), ()):
            if p.grad is None:
                continue
            m.grad = p.grad.detach().float()
            p.grad = None  # the model's fp16 grads would otherwise accumulate: zero_grad sees only masters

    def _masters_to_model(self, optimizer: Optimizer) -> None:
        pairs = self._masters.get(id(optimizer))
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    # ---- checkpointing -----------------------------------------------------------------------------------
    @override
    def state_dict(self) -> Dict[str, Any]:
        masters = [m.detach().cpu().clone() for pairs in self._masters.values() for _, m in pairs]
        return {"precision": self.precision,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "master_weights": masters}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "scale" in state_dict and "precision" not in state_dict:  # a bare GradScaler state (MixedPrecision)
            state_dict = {"scaler": state_dict}
        scaler_state = state_dict.get("scaler")
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
        elif self.scaler is not None:
            rank_zero_warn("TopKPrecision: the checkpoint has no loss-scaler state; starting from init_scale")
        masters = state_dict.get("master_weights") or []
        if masters and self.master_weights:
            if self._masters:
                self._load_masters(masters)
            else:
                self._pending_masters = masters

    def _load_masters(self, masters: List[Tensor]) -> None:
        mine = [m for pairs in self._masters.values() for _, m in pairs]
        if len(mine) != len(masters) or any(a.shape != b.shape for a, b in zip(mine, masters)):
            raise ValueError(f"TopKPrecision: checkpoint holds {len(masters)} master weights that do not match "
                             f"the {len(mine)} fp16/bf16 parameters of this model")
        with torch.no_grad():
            for m, saved in zip(mine, masters):
                m.copy_(saved)
        self._pending_masters = None
        for opt_id in self._masters:
            pairs = self._masters[opt_id]
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    @override
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # Lightning stored state_dict() under type(self).__qualname__; move it to the fixed key so renaming
        # or subclassing the plugin does not orphan the scaler state.
        state = checkpoint.pop(type(self).__qualname__, None)
        checkpoint[STATE_KEY] = state if state is not None else self.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        for key in (STATE_KEY, type(self).__qualname__, "TopKPrecision", "MixedPrecision"):
            if key in checkpoint:
                self.load_state_dict(checkpoint[key])
                return


def _check(name: str, value: Any, ok: Callable[[float], bool], rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not ok(value):
        raise ValueError(f"TopKPrecision: option '{name}' must be a number {rule}, got {value!r}")


def _topk_controller(module: Any) -> Any:
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    return getattr(strategy, "topk_controller", None)


def _is_dtensor(p: Tensor) -> bool:
    """A parameter sharded by FSDP2: torch's fused kernels have no DTensor rule for every optimizer (SGD)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _prefer_fused(opt: Optimizer) -> bool:
    """Switch a torch SGD/Adam/AdamW built with the default implementation choice to fused=True."""
    if type(opt) not in _FUSABLE:
        return False
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    for g in opt.param_groups:
        if g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable"):
            return False
        for p in g["params"]:
            if not p.is_floating_point() or p.device.type not in devices or p.is_sparse or _is_dtensor(p):
                return False
    for g in opt.param_groups:
        g["fused"] = True
    opt.defaults["fused"] = True
    opt._step_supports_amp_scaling = True
    opt._need_device_dtype_check_for_fused = True
    return True


class TopKPrecision(TopKPrecisionMixin, Precision):
    """Mixed precision with global overflow decisions, fused-optimizer clipping and top-k residual safety
    (``pytorch_lightning``); see :class:`TopKPrecisionMixin` for the arguments."""
