"""One process of a job reading its rows of steps START..STOP of the training stream, through the
loop's own reader (Data.train_batches), into OUT/<process>.npz: `python tests/read_windows.py
OUT START STOP DATA_OVERRIDES...` under `python -m jaxscale.launch` (tests/test_mixture.py)."""

import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import cli
from jaxscale.data import make_data
from jaxscale.runtime import distributed


def main(out: str, start: int, stop: int, overrides: list[str]) -> None:
    config = cli.load_config("configs/tiny.py", overrides)
    distributed.initialize(config.distributed)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    data = make_data(config, NamedSharding(mesh, P("data", None)))
    rows = {}
    for step, batch in zip(range(start, stop), data.train_batches(start)):
        for shard in batch["inputs"].addressable_shards:  # this process's rows, by global row index
            first = shard.index[0].start or 0
            for offset, row in enumerate(np.asarray(shard.data)):
                rows[f"{step}/{first + offset}"] = row
    np.savez(f"{out}/{jax.process_index()}.npz", **rows)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
