"""Every script in benchmarks/ runs once in its --smoke mode, so none of them rots.

Each runs in a fresh process with 8 fake CPU devices as `python benchmarks/NAME --smoke --json
--append ARGS`; the test parses the one JSON object it prints, checks it with the script's
check below, and checks that --smoke left benchmarks/results/ alone. A new benchmark is one entry in
BENCHMARKS: its file name, extra arguments, and a check of its JSON (or None for the common keys only).
"""

import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli_env
from jaxscale import config as config_lib
from sends import param_groups, state_bytes

BENCH = ROOT / "benchmarks"
# nccl-tests' definitions (doc/PERFORMANCE.md), for a row of SIZE bytes on an axis of n ranks:
# busbw / algbw, and the bytes each rank's collective returns.
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "collective-permute": lambda n: 1.0}
RESULT_BYTES = {"all-reduce": lambda size, n: size, "all-gather": lambda size, n: size,
                "reduce-scatter": lambda size, n: size // n, "all-to-all": lambda size, n: size,
                "collective-permute": lambda size, n: size}


def _check_collectives(out):
    assert {(r["axis"], r["axis_size"]) for r in out["rows"]} == {("data", 2), ("tensor", 4)}
    assert len(out["rows"]) == 2 * len(BUS_FACTOR)  # every collective on both axes, one size
    for r in out["rows"]:
        name, n = r["collective"], r["axis_size"]
        assert r["time_s"] > 0 and r["bytes"] == 1024
        assert r["bus_factor"] == pytest.approx(BUS_FACTOR[name](n))
        # The compiled program runs the collective the row names, on the size the row claims.
        assert r["hlo"] == {name: out["iters"]}
        assert r["hlo_result_bytes"] == {name: out["iters"] * RESULT_BYTES[name](r["bytes"], n)}


def _config(path: str, overrides: list[str]):
    config = config_lib.load(str(ROOT / path))
    config_lib.apply_overrides(config, overrides)
    return config


def _check_memory(out):
    """Each layout's compiled state and the script's arithmetic column against the arithmetic
    from the config alone (tests/sends.state_bytes), not from the layout the planner built."""
    assert [r["layout"] for r in out["rows"]] == ["data=8,zero_stage=1", "data=2,fsdp=4"]
    for r in out["rows"]:
        layout = [item if item.startswith("zero_stage") else f"mesh.{item}" for item in r["layout"].split(",")]
        config = _config(out["config"], [*out["overrides"], "mesh.data=1", *layout])
        got, want = r["per_device_bytes"], state_bytes(config, 8)
        assert r["num_params"] == sum(param_groups(config).values())
        for key in ("params", "grads", "opt_state"):
            assert got[key] == pytest.approx(want[key], rel=0.01), (r["layout"], key)
            assert r["expected_bytes"][key] == pytest.approx(want[key], rel=1e-6), (r["layout"], key)
        assert got["temp"] >= got["grads"] and got["total"] >= sum(want.values())  # the gradients are temporaries


def _check_overhead(out):
    assert out["loss_gap"] < 1e-4  # the bare step computes the same loss: the comparison is fair
    # Each first step includes compiling, which takes longer than a step of this tiny model.
    assert out["loop_first_step_s"] > out["loop_s"] > 0 and out["bare_first_step_s"] > out["bare_s"] > 0
    # The loop's step time includes the device work it waits for: it cannot be far below a bare
    # step of the same math (a loop timing only the dispatch would be ~100x below; measured 3.8).
    assert out["step_time_ratio"] > 0.2, out


def _check_context_parallel(out):
    rows = {r["mode"]: r for r in out["rows"]}
    assert list(rows) == ["none", "ring", "all_gather", "ulysses"]
    assert all(r["step_s"] > 0 and r["temp_bytes"] > 0 for r in rows.values())
    # Splitting the sequence over 2 devices cuts each one's temporaries (measured by 10% at this
    # short length, where the parameter-sized temporaries every mode has dominate).
    assert rows["ring"]["temp_bytes"] < rows["none"]["temp_bytes"]
    assert rows["all_gather"]["temp_bytes"] < rows["none"]["temp_bytes"]
    assert rows["ulysses"]["temp_bytes"] < rows["none"]["temp_bytes"]
    assert out["longest"] == {"none": 1024, "ring": 1024}  # a budget nothing reaches, capped at 1024


def _check_pipeline(out):
    """--smoke runs 1F1B alone (GPipe's table and memory: tests/test_pipeline.py)."""
    assert [(r["schedule"], r["microbatches"]) for r in out["rows"]] == [("1f1b", 2), ("1f1b", 4)]
    for r in out["rows"]:
        m = r["microbatches"]
        # 1F1B's table on 2 stages: 2M + 2 ticks, 2 of them idle on each stage. The
        # program runs that table: one transfer each way per tick. (The measured idle share is not
        # checked: at smoke size on a shared 2-core machine it is noise.)
        assert r["step_s"] > 0 and r["table_bubble"] == pytest.approx(2 / (2 * m + 2)) and r["ticks"] == 2 * m + 2
        assert r["hlo_permutes"] == 2 * r["ticks"], r
    assert [r["in_flight"] for r in out["rows"]] == [2, 2]  # 1F1B holds at most P, whatever M


def _check_search(out):
    """--smoke compiles the best candidate and pure FSDP (fsdp=8) and steps each once; the rank
    correlation is over those rows, and the first row is the search's choice."""
    rows = out["rows"]
    assert len(rows) in (1, 2) and "fsdp=8 none" in [r["layout"] for r in rows]
    assert all(0 < r["predicted_s"] and 0 < r["measured_s"] < out["test_wall_s"] for r in rows)
    assert (out["spearman"] is None if len(rows) == 1 else -1 <= out["spearman"] <= 1)
    assert out["odd_against_even_rounds"] is None  # one round: no halves to compare
    assert out["first_over_fastest"] == pytest.approx(
        rows[0]["measured_s"] / min(r["measured_s"] for r in rows))


def _check_maxtext(out):
    """--smoke writes a tiny jaxscale step (data=2 x fsdp=4) as benchmarks/_maxtext_compile.py
    writes MaxText's, and reads it back: the reader's collectives, per-chip total and overlap are
    the plan's own for the same compiled program."""
    plan, memory = out["plan"], out["memory"]
    assert out["mesh"] == {"data": 2, "fsdp": 4} and out["sent_bytes"] > 0
    assert out["collectives"] == plan["collectives"] and out["collectives_by_axis"] == plan["collectives_by_axis"]
    assert out["overlap"] == plan["overlap"] and out["exposed_bytes"] is None  # no target: nothing priced
    compiled = plan["compiled_bytes"]
    assert [memory[f"{k}_size_in_bytes"] for k in ("argument", "output", "temp", "alias")] == \
        [compiled[k] for k in ("argument", "output", "temp", "alias")]
    assert out["total_bytes"] == compiled["argument"] + compiled["output"] + compiled["temp"] - compiled["alias"]


def _check_checkpoint(out):
    """The state saved is the config's: float32 parameters and Adam's two moments, 12 bytes a
    parameter (N by hand, tests/sends.param_groups), and a few scalars (steps, counts, the key).
    The times it reports, the blocking ratio's two among them, are of operations run one after
    another (the first save, then a repeat's async save, sync save, restore, local save until
    written and local restore): together they fit in the whole process's wall time by the test's
    clock."""
    n = sum(param_groups(_config(out["config"], out["overrides"])).values())
    assert 12 * n <= out["state_bytes"] <= 12 * n + 1024 and out["repeats"] == 1  # one sample: its median
    timed = [out[key] for key in ("async_blocking_s", "sync_save_s", "restore_s", "local_written_s",
                                  "local_restore_s")]
    assert min(timed) > 0 and 0 < out["local_blocking_s"] and 0 < out["first_save_s"]
    assert out["first_save_s"] + sum(timed) <= out["test_wall_s"]


def _check_gpu(out):
    """--smoke runs one combination (remat's memory and losses: tests/test_step.py, test_model.py)."""
    (row,) = out["rows"]
    assert (row["remat"], row["flag_set"]) == ("dots_saveable", "jaxscale") and "error" not in row, row
    assert row["step_s"] > 0 and row["tokens_per_sec"] > 0 and row["temp_bytes"] > 0 and row["loss"] > 0
    assert row["mfu"] is None and row["device"] == "cpu"  # no known peak on CPU
    assert row["kernels_ms"] == {}  # --profile: a CPU's trace holds no GPU kernels


def _check_offload(out):
    rows = {r["mode"]: r for r in out["rows"]}
    assert list(rows) == ["none", "optimizer_state", "optimizer_state+params"]
    assert rows["none"]["host_bytes"] == 0 and rows["optimizer_state+params"]["device_bytes"] < 1024
    moved = rows["optimizer_state"]
    assert rows["none"]["device_bytes"] == moved["device_bytes"] + moved["host_bytes"]
    assert all(r["step_s"] > 0 for r in rows.values())


def _check_moe(out):
    """--smoke: a 2-layer model, dense and MoE rows (dropless drops nothing: tests/test_moe.py)."""
    rows = {r["layout"]: r for r in out["rows"]}
    assert list(rows) == ["dense, data", "moe, expert=2"]
    dense, moe = rows["dense, data"], rows["moe, expert=2"]
    assert all(r["temp_bytes"] > 0 for r in rows.values())
    assert moe["mesh"]["expert"] == 2 and moe["mesh"]["data"] == 4
    assert dense["params"] == dense["active_params"] < moe["active_params"] < moe["params"]
    assert moe["active_params"] - dense["active_params"] == 128 * 8  # the router: d_model x experts, 1 MoE layer
    assert all(r["step_s"] > 0 for r in rows.values())


def _check_data(out):
    bpe, raw = out["prepare"]["bpe"], out["prepare"]["bytes"]
    # One token a byte of text (plus one a document) is fewer than the file's JSON bytes; BPE merges more.
    assert 0 < bpe["tokens"] < raw["tokens"] < out["corpus_bytes"]
    assert out["limit"]["bpe"] > 0 and all(p["tokens_per_s"] > 0 and p["peak_mib"] > 0 for p in (bpe, raw))
    shares = out["loader"]["shares"]
    assert shares["mix_web"] == pytest.approx(0.7, abs=0.02) and shares["mix_small"] == pytest.approx(0.3, abs=0.02)
    assert out["loader"]["local_batch_windows_per_s"] > 0 and out["loader"]["train_batches_windows_per_s"] > 0
    assert out["step"]["windows_per_s"] > 0


def _check_torch_reference(out):
    """--shapes=gpt2: the Llama shape's hand-over and PyTorch model run in the cpu_profile smoke."""
    assert [r["shape"] for r in out["rows"]] == ["gpt2"]
    for r in out["rows"]:
        # The PyTorch side starts from jaxscale's parameters and batches: the same math, the same
        # first two losses (forward, then one AdamW update), to float32 rounding.
        assert r["losses"]["torch"] == pytest.approx(r["losses"]["jaxscale"], rel=1e-4), r
        assert r["losses"]["torch_in_process"] == pytest.approx(r["losses"]["torch"], rel=1e-6), r
        assert r["torch_process_imported"] == []  # PyTorch's own process: no JAX runtime beside it
        assert r["jaxscale_ms"] > 0 and r["torch_ms"] > 0 and r["torch_in_process_ms"] > 0
        assert r["tokens"] == 4 * 32  # --smoke: batch 4 of 32 tokens
    # Every timed round (per-step medians, `steps` steps a round) ran one after another, each
    # side in turn: together within the wall time of the whole process by the test's own clock.
    timed = sum(r[key] for r in out["rows"] for key in ("jaxscale_ms", "torch_ms", "torch_in_process_ms"))
    assert out["rounds"] * out["steps"] * timed / 1e3 <= out["test_wall_s"]


def _check_startup(out):
    (first,), (second,) = out["runs"]["first"], out["runs"]["second"]
    assert not first["from_cache"] and second["from_cache"]  # the second start loads the step, compiles nothing
    assert all(r["first_step_s"] > r["after_summary_s"] > 0 for r in (first, second))


def _check_cpu_profile(out):
    """The kinds and parts of the thunks' time; the model's FLOPs a step by hand from the shape
    (tiny.py with the smoke overrides: N = every parameter, the tied table once, as the head)."""
    assert set(out["kinds_ms"]) <= {"matmul", "copy/transpose", "broadcast", "stacked slices", "other fusions"}
    assert out["kinds_ms"]["matmul"] > 0
    assert len(out["top"]) == 12 and all(t["op"] for t in out["top"])  # each traced thunk found in the HLO
    # Every thunk lands in one of the parts the table names (one outside them is lost to it).
    assert sum(out["parts_ms"].values()) == pytest.approx(out["thunks_ms"])
    sys.path.insert(0, str(BENCH))
    from torch_reference import SHAPES, SMOKE

    config = _config("configs/tiny.py", [*SHAPES[out["shape"]], *SMOKE])
    m, t = config.model, config.train
    per_token = 6 * sum(param_groups(config).values()) + 12 * m.num_layers * m.d_model * t.seq_len
    assert out["model_gflop"] == pytest.approx(per_token * t.global_batch_size * t.seq_len / 1e9, rel=1e-9)
    torch_parts = out["torch"]["parts_ms"]
    assert torch_parts.keys() == out["parts_ms"].keys() and all(v > 0 for v in torch_parts.values())


BENCHMARKS = {  # file -> (extra arguments, check of its JSON)
    "torch_reference.py": (["--torch_in_process", "--shapes=gpt2"], _check_torch_reference),
    "startup.py": ([], _check_startup),
    "cpu_profile.py": ([], _check_cpu_profile),
    "data.py": ([], _check_data),
    "moe.py": ([], _check_moe),
    "offload.py": ([], _check_offload),
    "gpu.py": (["--profile"], _check_gpu),
    "checkpoint.py": ([], _check_checkpoint),
    "collectives.py": (["--mesh=data=2,tensor=4"], _check_collectives),
    "memory.py": ([], _check_memory),
    "overhead.py": ([], _check_overhead),
    "context_parallel.py": ([], _check_context_parallel),
    "pipeline.py": ([], _check_pipeline),
    "search.py": ([], _check_search),
    "maxtext_plan.py": ([], _check_maxtext),
}


def test_every_benchmark_is_smoke_tested():
    assert {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} == set(BENCHMARKS)


@pytest.mark.parametrize("script", sorted(BENCHMARKS))
def test_smoke(script):
    args, check = BENCHMARKS[script]
    results = {p.name: p.read_text() for p in (BENCH / "results").glob("*.md")}
    env = cli_env(8)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--json", "--append", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall_s = time.perf_counter() - began  # a clock outside the script, for checks of its timings
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["benchmark"] == script.removesuffix(".py") and {"date", "command", "machine"} <= set(out)
    if check is not None:
        check({**out, "test_wall_s": wall_s})
    assert {p.name: p.read_text() for p in (BENCH / "results").glob("*.md")} == results, "--smoke must not write"


def test_a_new_run_replaces_its_configurations_entry(tmp_path):
    """--append writes an entry per configuration (its heading): the same configuration again
    replaces its entry in place, another is added after the others."""
    sys.path.insert(0, str(BENCH))
    import _common

    path = tmp_path / "overhead.md"
    path.write_text("# Overhead\n\nWhat it measures.\n\n## a\n\nold a\n\n## b\n\nold b\n")
    _common.write_entry(path, "## a\n\nnew a\n")
    _common.write_entry(path, "## c\n\nnew c")
    assert path.read_text() == "# Overhead\n\nWhat it measures.\n\n## a\n\nnew a\n\n## b\n\nold b\n\n## c\n\nnew c\n"
    _common.write_entry(tmp_path / "fresh.md", "## x\n\nbody")
    assert (tmp_path / "fresh.md").read_text() == "# fresh\n\n## x\n\nbody\n"


def test_gpu_kernels_are_classed_by_name_and_hlo():
    """The GEMMs by the dtype they multiply in (a Triton GEMM fusion by its operands' types),
    cuDNN attention by direction, the optimizer by its HLO's op_name."""
    sys.path.insert(0, str(BENCH))
    from _kernels import kernel_class, table

    assert kernel_class("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32") == "GEMM fp32/tf32"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "GEMM bf16"
    fp8_fusion = ("%gemm_fusion_dot.14 = bf16[64,32]{1,0} fusion(%p, %q), calls=%c "
                  "%c (parameter_0: f8e5m2[64,16], parameter_1: f8e4m3fn[32,16]) -> bf16[64,32] {")
    assert kernel_class("gemm_fusion_dot_14", fp8_fusion) == "GEMM fp8"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention forward"
    assert kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention backward"
    assert kernel_class("loop_multiply_fusion_3", '%f = f32[8] fusion(), metadata={op_name="x/opt_state/mu"}') == \
        "optimizer"
    assert kernel_class("MemcpyD2D") == "copies" and kernel_class("input_reduce_fusion_2") == "reductions"
    assert "GEMM bf16 | 3.00 | 75.0%" in table({"GEMM bf16": 3.0, "copies": 1.0})
