"""Run on every rank by tests/distributed/test_engram_parallel.py: the row-parallel table vs the whole table.

In:  an output directory, through torchrun with 2 or 3 gloo ranks.
Out: ``table_rank{R}.json``: per dtype (fp32, bf16), whether this rank's lookups through its
     :class:`~ds_capture.parallel.engram_parallel.RowParallelTable` equal the whole table's bit for bit.

Every rank builds the same whole table (seed 0; 101 rows, so the last owner holds padding, and a -0.0 and a NaN
row that a summed exchange would alter) and its own ids: a different shape per rank ([B, S, heads] with B, S from
the rank), rank 1 also a call with no ids at all, the same number of calls on every rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_capture.parallel.dist import discover_env, distributed_session  # noqa: E402
from ds_capture.parallel.engram_parallel import RowParallelTable  # noqa: E402

ROWS, DIM, HEADS = 101, 16, 4
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def main() -> None:
    env = discover_env()
    results = []
    with distributed_session(env, backend="gloo", timeout_minutes=2):
        import torch.distributed as dist

        for dtype in (torch.float32, torch.bfloat16):
            whole = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)
            whole[7] = -0.0
            whole[ROWS - 1, 3] = float("nan")
            table = RowParallelTable(ROWS, DIM, group=dist.group.WORLD, group_size=env.world_size,
                                     group_rank=env.rank, dtype=dtype, device="cpu")
            start, count = table.owned_rows["weight"]
            with torch.no_grad():
                table.weight.zero_()
                table.weight[:count] = whole[start:start + count]
            ids_gen = torch.Generator().manual_seed(100 + env.rank)
            shapes = [(1 + env.rank, 5 + 3 * env.rank, HEADS), (2, 1, HEADS),
                      (0, 4, HEADS) if env.rank == 1 else (1, 2, HEADS)]
            equal, calls = True, 0
            for shape in shapes:
                ids = torch.randint(0, ROWS, shape, generator=ids_gen)
                if ids.numel():
                    ids.view(-1)[0], ids.view(-1)[-1] = 7, ROWS - 1  # the -0.0 and NaN rows
                with torch.no_grad():
                    got = table(ids)
                expected = torch.nn.functional.embedding(ids, whole)
                bits = BITS[dtype]  # compared as integers: -0.0 and NaN rows too
                same = got.shape == expected.shape and torch.equal(got.view(bits), expected.view(bits))
                equal, calls = equal and same, calls + 1
            results.append({"rank": env.rank, "world_size": env.world_size, "dtype": str(dtype), "equal": equal,
                            "calls": calls, "rows": [start, count], "local_rows": table.rows_per_rank})
    with open(os.path.join(sys.argv[1], f"table_rank{env.rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
