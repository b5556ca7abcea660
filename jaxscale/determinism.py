"""train.deterministic: steps that give the same bits every time they run.

On CPUs and TPUs XLA's programs already do (tests/test_step.py runs one twice and compares the
bits; a resumed run continues bit-identically, tests/test_checkpoint.py). On NVIDIA GPUs they do
not by default: reductions and scatter-adds (the embedding's gradient) use atomics whose order
varies. `train.deterministic=true` compiles the train and eval steps with XLA's
`xla_gpu_deterministic_ops` (ordered reductions, sorted scatters) and keeps cuDNN's attention
out (with that option its step dies in execute_sharded): models.attention.resolve_impl takes the
blockwise kernel for `auto` and refuses model.attention.impl=cudnn. The GPU compiler accepts the
program (tests/test_gpu_topology.py); its bits and its speed on a GPU are not measured here.
"""

from __future__ import annotations

GPU_OPTIONS = (("xla_gpu_deterministic_ops", True),)


def compiler_options(config, platform: str) -> tuple:
    """The XLA compiler options a run's steps compile with: XLA's deterministic GPU ops when
    train.deterministic asks on a GPU, else none."""
    return GPU_OPTIONS if config.train.deterministic and platform == "gpu" else ()
