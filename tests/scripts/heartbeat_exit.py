"""One rank of a 2-rank gloo job that starts the heartbeat (beating every 0.5 ms, so it is nearly always inside
a store call) and ends without the strategy's teardown or destroy_process_group, as a Fabric script does.
Exit code 0 expected; the bug was an abort at interpreter exit (exit -6)."""
import os
import time

import torch.distributed as dist

from lightning_topk.lightning.faults import Heartbeat

dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
hb = Heartbeat(dist.get_rank(), 2, interval=0.0005)
time.sleep(0.3)
dist.barrier()
