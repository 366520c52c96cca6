"""Probe run on every rank by tests/distributed/test_dist_launchers.py, through each real launcher.

In:  the launcher's environment; ``--tp N`` (TP sub-groups for the inference_all_reduce check),
     ``--no-repair`` (skip the shm repair, to show the trap), ``--fail`` (raise after agreeing, to
     exercise the error-path teardown).
Out: one ``PROBE {json}`` line per rank on stdout (what it discovered and computed); exit 0 on success.

    deepspeed --num_accelerators 2 --no_ssh_check --master_addr 127.0.0.1 tests/distributed/_probe_dist.py
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_capture.errors import CaptureError  # noqa: E402
from ds_capture.parallel.dist import (  # noqa: E402
    agree_on_error,
    all_reduce_max_int,
    discover_env,
    distributed_session,
    repair_cpu_allreduce,
    shm_buffer_glob,
)
from ds_capture.parallel.layout import build_layout, new_groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=0)
    parser.add_argument("--no-repair", action="store_true")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--local_rank", type=int)  # the deepspeed launcher appends it
    args = parser.parse_args()
    torch.set_num_threads(1)

    env = discover_env()
    report: dict = {"env": env.__dict__, "launcher_local_size": os.environ.get("LOCAL_SIZE")}
    with distributed_session(env, backend="gloo", timeout_minutes=2):
        world = torch.full((4,), float(env.rank + 1))
        torch.distributed.all_reduce(world)
        report["world_sum"] = world[0].item()
        report["max_rank"] = all_reduce_max_int(env.rank)
        report["shm_files_during_run"] = len(glob.glob(shm_buffer_glob(env.master_addr, env.master_port)))

        if args.tp:
            import deepspeed.comm as ds_dist

            plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=args.tp, ep_size=1,
                              num_experts=None, num_attention_heads=4, num_key_value_heads=None)
            groups = new_groups(plan)
            if not args.no_repair:
                repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == plan.world_size)
            # the op AutoTP's row-parallel layers call: must sum within the TP group only
            partial = torch.full((1024,), float(env.rank + 1))
            ds_dist.inference_all_reduce(partial, group=groups.tp_group)
            report["tp_ranks"] = plan.tp_ranks
            report["tp_sum"] = partial[0].item()
            report["shm_level"] = getattr(ds_dist.comm.cdb, "shm_vector_kernel_level", None)

        refusal = CaptureError("probe refusal on rank 0: output directory belongs to another run")
        try:
            agree_on_error(refusal if env.rank == 0 else None)
        except CaptureError as agreed:
            report["agreed"] = str(agreed)
        sys.stdout.write("PROBE " + json.dumps(report) + "\n")  # one write: ranks share the log
        sys.stdout.flush()
        if args.fail:
            raise SystemExit(3)


if __name__ == "__main__":
    main()
