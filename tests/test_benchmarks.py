"""Every script in benchmarks/ runs once in its --smoke mode, so none of them rots.

Each runs in a fresh process with 8 fake CPU devices as `python benchmarks/NAME --smoke --json
--append ARGS`; the test parses the one JSON object it prints, checks it with the script's
check below, and checks that --smoke left RESULTS.md alone. A new benchmark is one entry in
BENCHMARKS: its file name, extra arguments, and a check of its JSON (or None for the common keys only).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "benchmarks"
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "collective-permute": lambda n: 1.0}


def _check_collectives(out):
    assert {(r["axis"], r["axis_size"]) for r in out["rows"]} == {("data", 2), ("tensor", 4)}
    assert len(out["rows"]) == 2 * len(BUS_FACTOR)  # every collective on both axes, one size
    for r in out["rows"]:
        assert r["time_s"] > 0 and r["bytes"] == 1024
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * BUS_FACTOR[r["collective"]](r["axis_size"]))
        assert r["hlo"] == {r["collective"]: out["iters"]}  # the program runs what the row claims


def _check_memory(out):
    assert [r["layout"] for r in out["rows"]] == ["data=8,zero_stage=1", "data=2,fsdp=4"]
    for r in out["rows"]:
        got = r["per_device_bytes"]
        for key in ("params", "grads", "opt_state"):
            assert r["ratio"][key] == pytest.approx(1, rel=0.05), (r["layout"], key)
        assert got["temp"] > 0 and got["total"] >= got["params"] + got["opt_state"]


def _check_overhead(out):
    assert out["loop_s"] > 0 and out["bare_s"] > 0 and out["loss_gap"] < 1e-4
    assert out["step_time_ratio"] == pytest.approx(out["loop_s"] / out["bare_s"])
    assert out["compile_time_ratio"] == pytest.approx(out["loop_first_step_s"] / out["bare_first_step_s"])
    assert out["loop_first_step_s"] > out["loop_s"]  # the first step includes compiling


def _check_context_parallel(out):
    assert [r["mode"] for r in out["rows"]] == ["none", "ring", "all_gather"]
    assert all(r["step_s"] > 0 and r["temp_bytes"] > 0 for r in out["rows"])


def _check_pipeline(out):
    assert [r["microbatches"] for r in out["rows"]] == [2, 4]
    for r in out["rows"]:
        assert r["step_s"] > 0 and r["formula"] == pytest.approx(1 / (r["microbatches"] + 1))  # P=2
    assert out["fit"]["formula_ratio"] == 1.0


def _check_checkpoint(out):
    assert out["state_bytes"] > 0 and out["repeats"] == 1
    assert "first_save_s" in out and out["first_save_s"] > 0
    assert 0 < out["async_blocking_s"] and 0 < out["sync_save_s"] and 0 < out["restore_s"]
    assert out["blocking_ratio"] == pytest.approx(out["async_blocking_s"] / out["sync_save_s"])


def _check_gpu(out):
    assert [(r["remat"], r["flag_set"]) for r in out["rows"]] == [("none", "jaxscale"), ("full", "jaxscale")]
    for r in out["rows"]:
        assert "error" not in r, r
        assert r["step_s"] > 0 and r["tokens_per_sec"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])
        assert r["mfu"] is None and r["device"] == "cpu"  # no known peak on CPU


def _check_offload(out):
    rows = {r["mode"]: r for r in out["rows"]}
    assert list(rows) == ["none", "optimizer_state", "optimizer_state+params"]
    assert rows["none"]["host_bytes"] == 0 and rows["optimizer_state+params"]["device_bytes"] < 1024
    assert rows["none"]["device_bytes"] == rows["optimizer_state"]["device_bytes"] + rows["optimizer_state"]["host_bytes"]
    assert all(r["step_s"] > 0 for r in rows.values())


def _check_moe(out):
    rows = {r["layout"]: r for r in out["rows"]}
    assert list(rows) == ["dense, data", "moe, expert=2"]  # --smoke: two rows of a 2-layer model
    dense, moe = rows["dense, data"], rows["moe, expert=2"]
    assert moe["mesh"]["expert"] == 2 and moe["mesh"]["data"] == 4
    assert dense["params"] == dense["active_params"] < moe["active_params"] < moe["params"]
    assert moe["active_params"] - dense["active_params"] == 128 * 8  # the router: d_model x experts, 1 MoE layer
    assert all(r["step_s"] > 0 for r in rows.values()) and dense["step_ratio"] == 1.0


BENCHMARKS = {  # file -> (extra arguments, check of its JSON)
    "moe.py": ([], _check_moe),
    "offload.py": ([], _check_offload),
    "gpu.py": ([], _check_gpu),
    "checkpoint.py": ([], _check_checkpoint),
    "collectives.py": (["--mesh=data=2,tensor=4"], _check_collectives),
    "memory.py": ([], _check_memory),
    "overhead.py": ([], _check_overhead),
    "context_parallel.py": ([], _check_context_parallel),
    "pipeline.py": ([], _check_pipeline),
}


def test_every_benchmark_is_smoke_tested():
    assert {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} == set(BENCHMARKS)


@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_smoke(script):
    args, check = BENCHMARKS[script]
    results = (BENCH / "RESULTS.md").read_text()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--json", "--append", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["benchmark"] == script.removesuffix(".py") and {"date", "command", "machine"} <= set(out)
    if check is not None:
        check(out)
    assert (BENCH / "RESULTS.md").read_text() == results, "--smoke must not append"
