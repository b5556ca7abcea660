"""Page faults per execution of a program whose scratch buffer glibc would mmap afresh each time:
`python tests/scratch_faults.py off|on|on,large` prints one JSON object (tests/test_perf.py).

`on` makes jaxscale's CPU malloc settings before JAX starts; `large` then has `fit_scratch`, right
after the compile as the CLI calls it, take the program for one whose scratch buffers would not
fit eight times in a quarter of the memory: large blocks are mmapped afresh again, and the calls
fault as without the settings. (Called after executions instead, its trim could race the last
call's free of the scratch buffer, which the heap then served again without a fault.)
"""

import json
import resource
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from jaxscale.config import defaults
from jaxscale.runtime import cpu_malloc


@jax.jit
def scans(x):  # two running sums and a transpose: 64 MiB of intermediates in one scratch buffer
    return jnp.cumsum(jnp.cumsum(jnp.exp(x), 0), 1).T.sum(0)


def faults_per_call(compiled, x, calls: int) -> float:
    """The median of each call's minor page faults."""
    counts = []
    for _ in range(calls):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        compiled(x).block_until_ready()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(counts)[len(counts) // 2]


def main(modes: list[str]) -> None:
    made = cpu_malloc.apply_cpu_defaults(defaults().xla) if "on" in modes else []
    x = jnp.ones((2048, 4096), jnp.float32)
    compiled = scans.lower(x).compile()
    result = {"made": made}
    if "large" in modes:
        huge = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(temp_size_in_bytes=2**50))
        result.update(note=cpu_malloc.fit_scratch(huge), left=list(cpu_malloc.applied))
    faults_per_call(compiled, x, 20)  # the heap settles
    result.update(scratch=compiled.memory_analysis().temp_size_in_bytes, faults=faults_per_call(compiled, x, 9))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1].split(","))
