"""The layout search: the candidates it considers, the step-time model's arithmetic, a refusal, and
its written choice trained (on 8 fake CPU devices, equal to one device) and shown in a notebook."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import ROOT, main_cli
from jaxscale import cli
from jaxscale.analysis import cost, layouts, search
from jaxscale.analysis.plan_types import AxisCollective, EstimatedBytes, ExpectedRun, Flops, PipelineSummary, StepWork
from jaxscale.errors import ConfigError
from jaxscale.validate import validate

TINY = str(ROOT / "configs" / "tiny.py")


def test_the_candidates_are_the_layouts_the_model_allows():
    """tiny (4 heads, 2 KV heads, 2 layers, batch 16, seq 128) on 8 devices: every candidate
    validates; tensor never exceeds the heads, pipeline never the layers; pure FSDP and a 1F1B
    pipeline beside FSDP are among them, and ZeRO stages only where data splits."""
    config = cli.load_config(TINY, [])
    found = list(layouts.candidates(config, 8, 1, 8))
    for layout in found:
        validate(search.with_overrides(config, layout.overrides()), 8)
    described = {layout.describe() for layout in found}
    assert {"fsdp=8 none", "pipeline=2 fsdp=4 none 1f1b x2", "data=8 zero2 full"} <= described
    assert not any(layout.zero_stage == 3 for layout in found)  # inside one slice ZeRO-3 is fsdp
    assert all(layout.sizes["tensor"] <= 4 and layout.sizes["pipeline"] <= 2 for layout in found)
    assert all(layout.zero_stage == 0 for layout in found if layout.sizes["data"] == 1)
    assert not any(layout.sizes["expert"] > 1 for layout in found)  # a dense model has no experts to split
    # Meshes, counted by hand: tensor in {1, 2, 4} (4 heads), pipeline in {1, 2} (2 layers),
    # sequence with tensor x sequence <= 8, and data x fsdp the rest (each ordered split of it).
    # tensor 1: (s, p) = (1, 1) 4 splits of 8, (1, 2) 3, (2, 1) 3, (2, 2) 2, (4, 1) 2, (4, 2) 1,
    # (8, 1) 1 = 16; tensor 2: 3 + 2 + 2 + 1 + 1 = 9; tensor 4: 2 + 1 + 1 = 4.
    assert len({layout.mesh for layout in found}) == 29
    # With the sequence split, each context-parallel attention the heads allow: ulysses where each
    # device's heads (4 / tensor) divide by sequence.
    contexts = {(layout.sizes["sequence"], layout.sizes["tensor"], layout.context) for layout in found
                if layout.sizes["sequence"] > 1}
    assert {(4, 1, "ring"), (4, 1, "all_gather"), (4, 1, "ulysses"), (2, 2, "ulysses")} <= contexts
    assert (8, 1, "ulysses") not in contexts and (4, 2, "ulysses") not in contexts


def test_the_context_parallel_attentions_send_what_their_collectives_carry():
    """By arithmetic per device and step (2 layers, no remat; A: a device's queries, K/V: its
    keys and values, 2 KV heads of 4): ring passes K/V n - 1 hops three times, all_gather gathers
    them and reduce-scatters their gradients ((n - 1) K/V each), ulysses all-to-alls queries, K/V
    (repeated to 4 heads where 2 do not split) and output forward and back ((n - 1)/n of each):
    at a device's fixed share of the tokens, only ulysses' bytes stay bounded as n grows."""
    config = cli.load_config(TINY, [])
    t, m = config.train, config.model
    for n in (2, 4):
        sent = {}
        for mode in ("ring", "all_gather", "ulysses"):
            layout = layouts.Candidate((("data", 8 // n), ("pipeline", 1), ("fsdp", 1), ("expert", 1), ("sequence", n),
                                        ("tensor", 1)), 1, 0, "none", context=mode)
            work = layouts.estimate(config, layout, *search.model_numbers(config))
            sent[mode] = work.collectives_by_axis["estimate"]["sequence"].sent_bytes
        a = t.global_batch_size // (8 // n) * t.seq_len // n * m.d_model * 2  # dtype auto: 2 bytes an element
        kv = a * 2 * m.num_kv_heads / m.num_heads
        assert sent["ring"] == pytest.approx(2 * 3 * kv * (n - 1))
        assert sent["all_gather"] == pytest.approx(2 * 2 * kv * (n - 1))
        assert sent["ulysses"] == pytest.approx(2 * 2 * (2 * a + (kv if n == 2 else 2 * a)) * (n - 1) / n)


MACHINE = cost.Machine("test", peak_flops=1e15, efficiency=0.5, memory_bytes=80e9, memory_bandwidth=2e12,
                       fast=400e9, slow=50e9, fast_domain=8, latency_s=1e-5)


def _rows(by_axis):
    return {"all-gather": {axes: AxisCollective(**row) for axes, row in by_axis.items()}}


def _plan(mesh, by_axis, flops=1e15, stages=1, bubble=0.0, expected=None):
    return StepWork(mesh, "none", PipelineSummary(stages=stages, bubble_fraction=bubble), Flops(flops, flops),
                    EstimatedBytes(params=1e9, opt_state=2e9, temp=5e9, total=8e9), _rows(by_axis), expected)


def test_the_step_time_model_by_hand():
    """On two hosts of 8 (data across them): 1 PFLOP at half of 1 PFLOP/s is 2 s; the memory term
    (3 x 3 GB state + 2 x 5 GB temporaries) / 2 TB/s is 9.5 ms; 40 GB over data crosses hosts at
    50 GB/s (0.8 s, hidden under compute); 8 GB over tensor stays in a host at 400 GB/s (20 ms,
    exposed), plus 10 us for each of 100 collectives. A pipeline's 20% bubble stretches compute
    by 1/0.8, and its recomputed forward by 4/3."""
    mesh = {"data": 2, "pipeline": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 8}
    rows = {"data": {"count": 100, "sent_bytes": 40e9}, "tensor": {"count": 100, "sent_bytes": 8e9}}
    got = cost.predict(_plan(mesh, rows), MACHINE, {"data": 2})
    assert got.compute_s == pytest.approx(2.0) and got.memory_s == pytest.approx(9.5e-3)
    assert got.by_axis_s["data"] == pytest.approx(0.8 + 1e-3) and got.hidden_s == got.by_axis_s["data"]
    assert got.exposed_s == pytest.approx(0.02 + 1e-3)
    assert got.step_s == pytest.approx(2.0 + 9.5e-3 + 0.021)
    slow = cost.predict(_plan(mesh, {"data": {"count": 1, "sent_bytes": 200e9}}), MACHINE, {"data": 2})
    assert slow.step_s == pytest.approx(4.0 + 1e-5 + 9.5e-3)  # hidden no longer: the collective is the longer
    # what the step is expected to run (its executor's branches by their share) is what is priced
    expected = ExpectedRun(3e15, _rows({"tensor": {"count": 40, "sent_bytes": 3.2e9}}))
    piped = _plan(mesh, {"tensor": {"count": 100, "sent_bytes": 8e9}}, stages=2, bubble=0.2, expected=expected)
    got = cost.predict(piped, MACHINE)
    # a stage's share of the formula, its forward again (stages are rematerialised), over the ticks not idle
    assert got.compute_s == pytest.approx(2.0 * 4 / 3 / 0.8)
    assert got.exposed_s == pytest.approx(0.4 * (0.02 + 1e-3))
    # Sixteen virtual devices on one host's cores: their work adds up and an idle tick costs
    # nothing (the expected 3 PFLOP each), nothing overlaps.
    got = cost.predict(piped, dataclasses.replace(MACHINE, shared_cores=True))
    assert got.compute_s == pytest.approx(16 * 6.0) and got.memory_s == pytest.approx(16 * 9.5e-3)
    assert got.step_s == pytest.approx(got.compute_s + got.memory_s + 0.4 * 0.021)
    # sixteen tensor ranks cannot stay in a host of 8: their link is the slow one
    assert cost.link_speed(MACHINE, "tensor", {**mesh, "data": 1, "tensor": 16}, {}) == MACHINE.slow
    assert cost.link_speed(MACHINE, "data+tensor", mesh, {}) == MACHINE.slow


def test_a_topology_too_small_for_the_model_says_how_many_devices_it_needs():
    """Llama-3-8B (8.03B parameters, 16 bytes each in training) on 4 v5e chips of 16 GiB: one line
    naming --topology, and at least 8 chips."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (pip install 'jaxscale[tpu]')")
    result = main_cli(["--config=configs/llama3_8b.py", "--topology=v5e-4", "--search"], module="jaxscale.plan")
    assert result.returncode == 2 and result.stdout == "", result.stdout
    line = result.stderr.strip()
    assert "\n" not in line and "--topology" in line and "needs at least 8 devices" in line, line


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """tiny's search on the 8 fake devices, 2 candidates and pure FSDP compiled, the best written as JSON."""
    path = tmp_path_factory.mktemp("search") / "best.json"
    result = main_cli([f"--config={TINY}", "--config.train.global_batch_size=16", "--search", "--compile=2",
                       "--workers=1", f"--write={path}", "--tokens=1e9"], module="jaxscale.plan")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(path.read_text()), result.stdout


def test_the_search_prints_a_ranked_table_and_the_command(chosen):
    overrides, out = chosen
    lines = out.splitlines()
    assert lines[0].startswith("search: ") and "compiled for cpu x8 (8 devices)" in lines[0]
    ranked = [line for line in lines if line[:2].strip().isdigit()]
    steps = [float(line[len(line.split("  ")[0]):].split()[2]) for line in ranked]  # the step ms column
    assert len(ranked) >= 2 and steps == sorted(steps), out
    flags = " ".join(f"--config.{k}={v!r}" if isinstance(v, str) else f"--config.{k}={v}" for k, v in overrides.items())
    assert lines[-1] == f"best: python -m jaxscale.train --config={TINY} {flags}"


def test_the_written_layout_trains_as_one_device_does(chosen, tmp_path):
    """The JSON's overrides, as --config flags, train tiny on 8 devices to one device's losses (fp32,
    1e-5), the one-device run from a notebook's Trainer, whose search ranks its own device's layouts."""
    from jaxscale import Trainer

    overrides, _ = chosen
    steps = ["train.steps=3", "train.log_every=1", "train.eval_every=0", "checkpoint.every_steps=0",
             "tracking.writers='jsonl'", "tracking.report=False", "metrics.progress=False"]
    flags = [f"--config.{k}={v!r}" if isinstance(v, str) else f"--config.{k}={v}" for k, v in overrides.items()]
    workdir = tmp_path / "eight"
    result = main_cli([f"--config={TINY}", f"--workdir={workdir}", *flags, *(f"--config.{s}" for s in steps)])
    assert result.returncode == 0, result.stderr[-2000:]
    eight = [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    config = cli.load_config(TINY, steps + ["mesh.data=1"])
    with Trainer(config, tmp_path / "one", devices=jax.devices()[:1]) as trainer:
        one = [r["loss"] for r in trainer.run(3)]
        table = trainer.plan(search=True, compile=2)
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) in (2, 3)  # + the baseline
    assert all(r["overrides"]["mesh.data"] == 1 for r in rows) and rows[0]["step_s"] <= rows[1]["step_s"]
    assert (tmp_path / "one" / "search.png").stat().st_size > 10_000


def test_an_unknown_search_flag_value_is_one_line():
    result = main_cli([f"--config={TINY}", "--search", "--compile=many"], module="jaxscale.plan")
    assert result.returncode == 2 and "--compile" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_search_refuses_this_hosts_gpus_without_a_topology(monkeypatch):
    """Only CPU devices are measured here; accelerators are described by their datasheets."""
    from jaxscale import plan

    class Gpu:
        platform = "gpu"

    monkeypatch.setattr(jax, "devices", lambda: [Gpu()])
    with pytest.raises(ConfigError, match="--topology=h100-8"):
        plan.search_target()
