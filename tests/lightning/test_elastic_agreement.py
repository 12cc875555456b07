"""Replica groups that meet holding different weights under torchft (``TorchFTReplica._check_agreement``), on real
gloo processes: the quorum's fingerprints are gathered on an :class:`ElasticGroup` over a plain torch process group;
the Manager's two fields it reads are stubbed (no lighthouse)."""
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed


class _Manager:
    """What :meth:`TorchFTReplica._check_agreement` reads of torchft's Manager."""

    def __init__(self) -> None:
        self.errors = []

    def errored(self):
        return self.errors[0] if self.errors else None

    def current_step(self) -> int:
        return 7


def _agreement(rank, world, weights):
    from lightning_topk.comm.config import TopKConfig
    from lightning_topk.comm.elastic import ElasticGroup
    from lightning_topk.lightning.elastic import TorchFTReplica

    m = _Manager()
    ft = TorchFTReplica(TopKConfig(fault_tolerance="torchft", min_replicas=1), dict, lambda sd: None,
                        fingerprint=lambda: float(torch.tensor(weights[rank], dtype=torch.float32).double().sum()))
    ft.manager = m
    ft.group = ElasticGroup(dist.group.WORLD, size=lambda: world, rank=lambda: rank, on_error=m.errors.append,
                            errored=m.errored)
    try:
        ft._check_agreement(world)
    except RuntimeError as e:
        return str(e)
    return None


def test_replicas_that_met_with_different_weights_fail_loudly():
    """Replica groups that committed the same steps in separate quorums (torchft heals only one that is behind)
    hold different weights when they meet: every one of them raises, naming min_replicas; equal weights pass."""
    same = run_distributed(_agreement, world=3, args=([[1.0, 2.0]] * 3,))
    assert same == [None, None, None]
    apart = run_distributed(_agreement, world=3, args=([[1.0, 2.0], [1.0, 2.0], [1.0, 2.5]],))
    assert all(e is not None and "hold different weights" in e and "min_replicas" in e and "step 7" in e
               for e in apart), apart
