"""Pipeline schedules as tables: what each holds and idles, the checks that reject a schedule
that cannot run, and the compiled step's memory against the microbatch count."""

import numpy as np
import pytest

from conftest import ROOT
from jaxscale import config as config_lib
from jaxscale import plan as plan_lib
from jaxscale.parallel import executor, schedules
from jaxscale.parallel.schedules import B, F, ScheduleError


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 5)])
def test_gpipe_and_1f1b_idle_as_the_formula_and_1f1b_holds_at_most_p(stages, micro):
    gpipe, one = schedules.build("gpipe", stages, micro), schedules.build("1f1b", stages, micro)
    for table in (gpipe, one):
        assert table.ticks == 2 * (micro + stages - 1)
        assert table.bubble() == pytest.approx((stages - 1) / (micro + stages - 1))
    assert gpipe.in_flight().tolist() == [micro] * stages
    assert one.in_flight().tolist() == [min(stages - s, micro) for s in range(stages)]


def test_interleaved_and_zero_bubble_bound_what_they_hold():
    inter = schedules.build("interleaved_1f1b", 4, 16, 2)
    circular = schedules.build("circular", 4, 16, 2)
    assert circular.in_flight().max() == 32 and inter.in_flight().max() < 16  # Megatron's warm-up, not V*M
    assert inter.bubble() == pytest.approx(circular.bubble()) == pytest.approx(3 / (2 * 16 + 3))
    zb = schedules.build("zero_bubble", 4, 16)
    assert zb.split_backward and set(np.unique(zb.kind)) == {0, 1, 2, 3}
    assert zb.in_flight().max() <= schedules.build("1f1b", 4, 16).in_flight().max() + 1


def test_the_executor_gives_each_stage_the_stash_slots_its_table_needs():
    for name, virtual in (("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)):
        table = schedules.build(name, 4, 8, virtual)
        assert executor.plan(table).x_slots == table.in_flight().max(), name


def test_a_schedule_that_runs_an_action_before_its_input_is_refused():
    table = schedules.build("1f1b", 2, 2)
    kind = table.kind.copy()
    t = int(np.nonzero(kind[:, 1] == B)[0][0])
    kind[[t, t - 1], 1] = kind[[t - 1, t], 1]  # B0 on stage 1 before its F0
    micro, vstage = table.micro.copy(), table.vstage.copy()
    micro[[t, t - 1], 1], vstage[[t, t - 1], 1] = micro[[t - 1, t], 1], vstage[[t - 1, t], 1]
    broken = schedules.Table(kind, micro, vstage, 2, 2, 1)
    with pytest.raises(ScheduleError, match="comes before what it needs"):
        schedules.check(broken)


@pytest.mark.parametrize("text, words", [
    ("F0 F1 B0 B1\nB0 F0 F1 B1\n", "deadlocks: stage 0 waits forever at B0, stage 1 waits forever at B0"),
    ("F0 F1 B0 B1\nF0 F1 B1\n", "stage 1 misses B0: each stage lists F and B of each microbatch 0..1"),
    ("F0 F1 B0 B1 X2\nF0 F1 B0 B1\n", "'X2' is not an action"),
    ("F0 F1 B0 B1\n", "1 stage lines; the mesh has 2"),
])
def test_a_bad_schedule_file_names_what_is_wrong(tmp_path, text, words):
    path = tmp_path / "schedule.txt"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=words):
        schedules.load(str(path), 2, 2)


def test_a_schedule_file_is_placed_in_ticks_and_drawn(tmp_path):
    path = tmp_path / "schedule.txt"
    path.write_text("# 1F1B with the weight gradients split off\n"
                    "stage 0: F0 F1 B0 W0 B1 W1\nstage 1: F0 B0 F1 B1 W0 W1\n")
    table = schedules.load(str(path), 2, 2)
    assert table.split_backward and table.draw() == "stage 0: FF.BWBW\nstage 1: .FBFBWW"
    assert (table.kind[:, 0] == F).sum() == 2


def _temp(schedule: str, virtual: int, micro: int) -> int:
    """Per-device temporaries of the compiled step: 4 layers on 2 stages, one row per microbatch."""
    config = config_lib.load(str(ROOT / "configs" / "tiny.py"))
    config_lib.apply_overrides(config, ["mesh.data=4", "mesh.pipeline=2", "model.num_layers=4",
                                        f"pipeline.schedule={schedule}", f"pipeline.virtual_stages={virtual}",
                                        f"pipeline.microbatches={micro}", f"train.global_batch_size={4 * micro}"])
    _, compiled, _ = plan_lib.compile_plan(config, "cpu")
    return compiled.memory_analysis().temp_size_in_bytes


ACTIVATION = 128 * 128 * 4  # one microbatch's [1, seq 128, d_model 128] float32 activations
CHUNK_WEIGHTS = 787456      # one layer of tiny.py at d_model 128 (float32): a circular stage chunk


def test_1f1b_memory_stays_flat_as_microbatches_grow_and_gpipe_grows():
    """From the compiled program, M = 4 -> 16 at a fixed microbatch size: 1F1B and interleaved
    1F1B within 10% (they hold at most their warm-up's microbatches); GPipe and circular hold
    every microbatch's stage input (12 more, x2 chunks for circular), and circular no longer a
    copy of its stage's weights per tick (before: about a chunk's weights per microbatch)."""
    temps = {(s, m): _temp(s, v, m) for s, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1),
                                                 ("circular", 2)) for m in (4, 16)}
    for flat in ("1f1b", "interleaved_1f1b"):
        assert temps[(flat, 16)] <= 1.1 * temps[(flat, 4)], temps
    assert temps[("gpipe", 16)] - temps[("gpipe", 4)] >= 12 * ACTIVATION
    growth = temps[("circular", 16)] - temps[("circular", 4)]
    assert 2 * 12 * ACTIVATION <= growth < 12 * CHUNK_WEIGHTS / 2, temps
