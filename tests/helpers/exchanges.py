"""Shortcuts for tests that drive exchanges by hand (without the strategy)."""
from lightning_topk.comm.exchanges import Layout
from lightning_topk.comm.exchanges.auto import AutoExchange


def make_auto(st, model, candidates, rank=0, groups=None, timed=True):
    """An :class:`AutoExchange` over a hand-made cost model, installed as ``st``'s exchange."""
    groups = groups if groups is not None else st.groups
    a = AutoExchange(st, Layout(model.nodes, model.local, rank), model=model, candidates=list(candidates),
                     timed=timed, groups=groups)
    st.exchange = st.exchanges["auto"] = a
    return a


def plan(st):
    """``exchange="auto"``'s plan of ``st`` (empty for another exchange)."""
    return dict(getattr(st.exchange, "plan", {}) or {})


def owner_residuals(st):
    """Every exchange's live owner residuals of ``st``, by key."""
    out = {}
    for ex in st.exchanges.values():
        owners = getattr(ex, "owners", None)
        if owners is not None:
            out.update(owners.live)
    return out


def dormant_allgather_hook(ddp, model):
    """``model``'s :class:`TopKState` at density 1 on the all-gather exchange (recipe off), registered as ``ddp``'s
    comm hook: the state a live recipe test engages by hand. Returns (config, state)."""
    from lightning_topk.comm.config import TopKConfig
    from lightning_topk.comm.exchanges import exchange_hook
    from lightning_topk.comm.state import TopKState

    dormant = TopKConfig(density=1.0, exchange="allgather", recipe="none")
    st = TopKState(dormant)
    st.bind(model.named_parameters())
    st.exchange = st.exchange_for("allgather")
    ddp.register_comm_hook(st, exchange_hook)
    return dormant, st
