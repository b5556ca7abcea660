"""jaxscale.analysis.overlap: hand-written scheduled HLO for each rule (the matmuls between a
collective's start and done, loops, pipelined collectives, shared compute, the TPU compiler's
continuation fusions and SparseCore offloads), and the step-time model pricing what stays exposed."""

import pytest
from test_hlo_stats import COND, entry, loop_body, module, while_line

from jaxscale.analysis import cost, hlo_stats, overlap
from jaxscale.analysis.plan_types import Flops, MemoryRows, PipelineSummary, StepWork, Window

MESH = {"data": 8}
GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"
# f32[16,32] x f32[32,8]: 2 x 16 x 8 x 32 FLOPs
DOT = "%d{n} = f32[16,8]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"
DOT_FLOPS = 2 * 16 * 8 * 32
OPERANDS = ("%a = f32[16,32]{1,0} parameter(1)", "%b = f32[32,8]{1,0} parameter(2)")


def windows(text: str) -> dict[tuple[str, float], float]:
    """{(kind, FLOPs beside): runs} of a module's collectives."""
    found = overlap.windows(*hlo_stats.parse_module(text, {}), MESH)
    assert all(w.axes == "data" for w in found)
    return {(w.kind, w.flops_beside): w.runs for w in found}


def test_the_matmuls_between_start_and_done_are_beside_it_and_a_blocking_collective_has_none():
    text = module(entry(*OPERANDS,
                        f"%s = (f32[2,8]{{1,0}}, f32[16,8]{{1,0}}) all-gather-start(%q), {GROUP}, dimensions={{0}}",
                        DOT.format(n=1), DOT.format(n=2),
                        "%g = f32[16,8]{1,0} all-gather-done(%s)",
                        DOT.format(n=3),
                        f"%r = f32[16]{{0}} all-reduce(%p), {GROUP}, to_apply=%add.clone"))
    assert windows(text) == {("all-gather", 2 * DOT_FLOPS): 1, ("all-reduce", 0): 1}


def test_matmuls_in_flight_beside_two_collectives_are_shared_between_them():
    text = module(entry(*OPERANDS,
                        f"%s1 = (f32[2]{{0}}, f32[16]{{0}}) all-gather-start(%p), {GROUP}, dimensions={{0}}",
                        DOT.format(n=1),
                        f"%s2 = f32[16]{{0}} all-reduce-start(%p), {GROUP}, to_apply=%add.clone",
                        DOT.format(n=2),
                        "%g1 = f32[16]{0} all-gather-done(%s1)",
                        DOT.format(n=3),
                        "%g2 = f32[16]{0} all-reduce-done(%s2)"))
    assert windows(text) == {("all-gather", 1.5 * DOT_FLOPS): 1, ("all-reduce", 1.5 * DOT_FLOPS): 1}


def test_a_loop_runs_its_windows_every_trip_and_a_pipelined_one_wraps_round_into_the_next():
    """The body computes, finishes the gather the previous trip started, computes again and starts
    the next: beside each gather is the rest of one trip (nothing) and the start of the next (the
    first matmul)."""
    body = loop_body("body.1", "%c = s32[] constant(0)", *OPERANDS,
                     DOT.format(n=1),
                     "%g = f32[16]{0} all-gather-done(%s)",
                     DOT.format(n=2),
                     f"%s = (f32[2]{{0}}, f32[16]{{0}}) all-gather-start(%v.body.1), {GROUP}, dimensions={{0}}")
    text = module(COND, body, entry(while_line("w", "body.1", 4)))
    assert windows(text) == {("all-gather", DOT_FLOPS): 4}


def test_an_async_wrapper_and_its_update_are_one_window():
    wrapped = f"""%wrapped_rs (p0: f32[64]) -> f32[8] {{
  %p0 = f32[64]{{0}} parameter(0)
  ROOT %rs = f32[8]{{0}} reduce-scatter(%p0), {GROUP}, dimensions={{0}}, to_apply=%add.clone
}}
"""
    text = module(wrapped, entry(*OPERANDS,
                                 "%as = ((f32[64]{0}), f32[8]{0}, s32[]) async-start(%x), calls=%wrapped_rs",
                                 DOT.format(n=1),
                                 "%au = ((f32[64]{0}), f32[8]{0}, s32[]) async-update(%as), calls=%wrapped_rs",
                                 DOT.format(n=2),
                                 "%ad = f32[8]{0} async-done(%au), calls=%wrapped_rs"))
    assert windows(text) == {("reduce-scatter", 2 * DOT_FLOPS): 1}
    assert hlo_stats.collective_stats(text)["reduce-scatter"]["count"] == 1


# libtpu's two forms of a reduce-scatter offloaded to the SparseCores (shapes cut down): 0.0.42's
# call-start .. call-done, and 0.0.52's custom-call-start, a custom-call-update, custom-call-done.
SPARSECORE_FORMS = {
    "call": ("%rs.call-start = ((f32[64]{0}, token[]), f32[8]{0}) call-start(%x, %t), "
             'async_execution_thread="sparsecore", to_apply=%called_computation.3',
             "%rs.call-done = f32[8]{0} call-done(%rs.call-start)"),
    "custom-call": ("%rs.call-start = ((), (), (s32[8]{0})) custom-call-start(), async_execution_thread="
                    '"sparsecore", custom_call_target="", called_computations={%called_computation.3}',
                    "%rs.call-update = ((f32[64]{0}), f32[8]{0}, (s32[8]{0})) custom-call-update(%rs.call-start, %x), "
                    'async_execution_thread="sparsecore", custom_call_target="", '
                    "called_computations={%called_computation.3}",
                    "%rs.call-done = f32[8]{0} custom-call-done(%rs.call-update)"),
}


@pytest.mark.parametrize("form", SPARSECORE_FORMS)
def test_a_collective_offloaded_to_the_sparsecores_is_one_window_beside_the_tensorcores_compute(form):
    """libtpu's forms of a reduce-scatter offloaded to the SparseCores: a start of a computation
    run on the `sparsecore` thread, the TensorCores' matmuls, then its done."""
    offloaded = f"""%called_computation.3 (p0: f32[64], p1: token[]) -> f32[8] {{
  %p0 = f32[64]{{0}} parameter(0)
  ROOT %rs = f32[8]{{0}} reduce-scatter(%p0), {GROUP}, dimensions={{0}}, to_apply=%add.clone
}}, execution_thread="sparsecore"
"""
    start, *middle, done = SPARSECORE_FORMS[form]
    text = module(offloaded, entry(*OPERANDS, "%t = token[] after-all()", start, DOT.format(n=1), *middle,
                                   DOT.format(n=2), done))
    assert windows(text) == {("reduce-scatter", 2 * DOT_FLOPS): 1}
    assert hlo_stats.collective_stats(text)["reduce-scatter"] == {"count": 1, "bytes": 8 * 4}


# The TPU compiler's continuation fusion, as libtpu writes it (shapes cut down): the gather starts
# in one fusion, steps on inside the fusion that computes beside it, and ends in another; each
# holds a copy of the collective. Its matmul is a convolution with a padded window.
AG = f"all-gather(%p0), {GROUP}, dimensions={{1}}"
W, WG = "bf16[1,16,8,4]{1,3,2,0}", "bf16[1,64,8,4]{1,3,2,0}"  # a weight's shard, and gathered
TPU_CHAIN = f"""%start_computation (p0: bf16[1,16,8,4]) -> (bf16[1,16,8,4], bf16[1,64,8,4]) {{
  %p0 = {W} parameter(0)
  %all-gather.1 = {WG} {AG}
  ROOT %cc.1 = ({W}, {WG}) custom-call(%p0, %all-gather.1), custom_call_target="Start"
}}

%async_collective_fusion.7 (p0: bf16[1,16,8,4], x: bf16[2,64,64,1], k: bf16[64,8,4,1]) -> bf16[2,64,8,4] {{
  %x = bf16[2,64,64,1]{{1,2,3,0}} parameter(1)
  %k = bf16[64,8,4,1]{{0,2,1,3}} parameter(2)
  %convolution.1 = bf16[2,64,8,4]{{3,1,2,0}} convolution(%x, %k), window={{size=1x8 pad=0_0x7_7 rhs_reversal=0x1}}, \
dim_labels=0bf1_i1o0->0b1f
  %p0 = {W} parameter(0)
  %all-gather.2 = {WG} {AG}
  ROOT %tuple.1 = (bf16[2,64,8,4]{{3,1,2,0}}, {WG}) tuple(%convolution.1, %all-gather.2)
}}

%done_computation (p0: bf16[1,16,8,4]) -> bf16[1,64,8,4] {{
  %p0 = {W} parameter(0)
  %all-gather.3 = {WG} {AG}
  ROOT %cc.3 = {WG} custom-call(%p0, %all-gather.3), custom_call_target="Done"
}}
"""
# x[2 x 64 rows, 64] @ w[64, 8 x 4]: the window runs over the 8 heads, one tap of each inside the input
CONV_FLOPS = 2 * (2 * 64) * 64 * (8 * 4)


def test_a_tpu_continuation_fusion_is_one_collective_hidden_behind_the_compute_it_steps_through():
    text = module(TPU_CHAIN, entry(
        "%w = bf16[1,16,8,4]{1,3,2,0} parameter(1)", "%x = bf16[2,64,64,1]{1,2,3,0} parameter(2)",
        "%k = bf16[64,8,4,1]{0,2,1,3} parameter(3)",
        "%async-collective-start.7 = (bf16[1,16,8,4]{1,3,2,0}, bf16[1,64,8,4]{1,3,2,0}) fusion(%w), kind=kOutput, "
        "calls=%start_computation",
        "%fusion.7 = (bf16[2,64,8,4]{3,1,2,0}, bf16[1,64,8,4]{1,3,2,0}) fusion(%w, %x, %k), kind=kOutput, "
        "calls=%async_collective_fusion.7",
        "%async-collective-done.7 = bf16[1,64,8,4]{1,3,2,0} fusion(%w), kind=kOutput, calls=%done_computation"))
    stats = hlo_stats.collective_stats(text)
    assert stats["all-gather"] == {"count": 1, "bytes": 64 * 8 * 4 * 2}  # counted once, at its start
    assert windows(text) == {("all-gather", CONV_FLOPS): 1}
    computations, entry_name = hlo_stats.parse_module(text, {})
    assert hlo_stats.computation_totals(entry_name, computations, {})["convolution"] == [1, CONV_FLOPS]


def test_the_step_time_model_prices_only_what_the_compute_beside_cannot_hide():
    """Two gathers of 1 GB over data on a machine with a 100 GB/s link and 100 TFLOP/s of matmuls:
    one with 5 TFLOP beside it (50 ms, longer than its 10 ms) is hidden, one with 0.5 TFLOP (5 ms)
    has 5 ms exposed, and a blocking one all 10 ms."""
    machine = cost.Machine("m", 200e12, 0.5, 1e12, 1e15, 100e9, 100e9, 8, 0.0)
    work = StepWork({"data": 8}, "none", PipelineSummary(stages=1), Flops(10e12, 10e12),
                    MemoryRows(0, 0, 0, 0, 0, 0, 0), {},
                    windows=(Window(axes="data", kind="all-gather", sent_bytes=1e9, flops_beside=5e12, runs=1),
                             Window(axes="data", kind="all-gather", sent_bytes=1e9, flops_beside=0.5e12, runs=1),
                             Window(axes="data", kind="all-reduce", sent_bytes=1e9, flops_beside=0.0, runs=1)))
    predicted = cost.predict(work, machine)
    assert predicted.hidden_s == pytest.approx(0.015) and predicted.exposed_s == pytest.approx(0.015)
    assert predicted.step_s == pytest.approx(0.1 + 0.015)  # 10 TFLOP of matmuls, then what is exposed
    rows = overlap.by_axis(work.windows, machine, lambda axes: 100e9)
    assert rows["data"].hidden_bytes == pytest.approx(1.5e9) and rows["data"].exposed_bytes == pytest.approx(1.5e9)
    assert rows["data"].async_bytes == 2e9
