"""One rank of a torchrun job used by the distributed tests: runs ``train()`` once per job.

Usage: ``torchrun --nproc-per-node=2 _worker.py JOBS.json`` where JOBS.json is a list of
``{"config": <RunConfig dict> | null, "out": dir | null, "resume": dir | null,
"max_steps": int | null, "uneven_targets": bool}`` (uneven_targets: CLM targets masked
unequally per row, see _uneven.py; the patch stays installed, so such a job comes last). The
script forms the process group itself, because torch resets its group counter on
destroy_process_group, and a second init in the same torchrun process reuses stale rendezvous
keys (a hang); ``train()`` uses an existing group and leaves it open. The shutdown is the one
train() does for a group it owns.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist

from lmlab.config import config_from_dict
from lmlab.training.trainer import train

HANG_S = 90  # a job (a hung collective) running longer fails the test, with stacks


def main(path: str) -> None:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    dist.init_process_group("gloo")
    for job in json.loads(Path(path).read_text()):
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # each job its own 90 s
        if job.get("uneven_targets"):  # stays installed: give it as the last job
            from _uneven import patch_uneven_clm

            patch_uneven_clm(setattr)
        cfg = config_from_dict(job["config"]).validate() if job.get("config") else None
        train(
            cfg,
            out=job.get("out"),
            resume=job.get("resume"),
            max_steps=job.get("max_steps"),
            progress=False,
        )
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
