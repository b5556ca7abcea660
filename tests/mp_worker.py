"""One process of a 2-process x 4-device run on this machine (spawned by test_multiprocess.py)."""

import json
import sys

import jax


def main(port: str, process_id: str, workdir: str, overrides: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(process_id), local_device_ids=list(range(4)))
    from jaxscale import config as config_lib
    from jaxscale.loop import train

    config = config_lib.defaults()
    config_lib.apply_overrides(config, json.loads(overrides))
    from jaxscale.data import process_rows
    from jaxscale.sharding import layout_from_config

    batch = layout_from_config(config)[0].batch_sharding()
    rows = process_rows(batch, (config.train.global_batch_size, config.train.seq_len))
    print(f"process {process_id} reads rows {rows.start}:{rows.stop}", flush=True)
    train(config, workdir, show_progress=False)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
