"""device_groups: every form of device groups XLA prints, read as the mesh axes they span."""

import pytest

from jaxscale.analysis import device_groups
from jaxscale.analysis.hlo_stats import step_totals

MESH = {"data": 2, "fsdp": 4}  # device i at numpy.unravel_index(i, (2, 4))


@pytest.mark.parametrize("line, axes", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", "fsdp"),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add", "data"),
    ("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", "data"),  # columns of the 2x4 grid
    ("replica_groups=[2,4]<=[8], to_apply=%add", "fsdp"),
    ("replica_groups=[1,8]<=[8], to_apply=%add", "data+fsdp"),
    # XLA's own 2x4 device array [[0,1,4,5],[2,3,6,7]], reduced over its first axis: 0 with 2, 4 with 6...
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, dimensions={0}", "fsdp"),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true", "data"),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1','axis_2'}, to_apply=%add", "fsdp"),
    ("source_target_pairs={{0,4},{4,0},{1,5},{5,1}}", "data"),
    ("source_target_pairs={{0,0},{1,1}}", device_groups.NONE),
    ("replica_groups={}, to_apply=%add", "data+fsdp"),
    ("to_apply=%add", "data+fsdp"),  # no groups named: every device
    ("replica_groups=mesh['axis_0'=4] {'axis_0':(1)2}, to_apply=%add", device_groups.UNKNOWN),
])
def test_groups_are_read_as_mesh_axes(line, axes):
    assert device_groups.describe(device_groups.spec(line), MESH)[0] == axes


@pytest.mark.parametrize("kind, n, sent", [("all-reduce", 8, 14.0), ("all-gather", 8, 7.0), ("all-to-all", 4, 6.0),
                                           ("reduce-scatter", 4, 24.0), ("collective-permute", 2, 8.0),
                                           ("all-reduce", 1, 0.0)])
def test_bytes_each_device_sends(kind, n, sent):
    assert device_groups.sent_bytes(kind, 8, n) == sent


def test_a_fused_tpu_reduce_scatter_takes_its_inner_all_reduce_groups():
    text = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%all-reduce-scatter.1 (p: f32[16]) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  %ar = f32[16]{0} all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %d = f32[4]{0} slice(%ar), slice={[0:4]}
}

ENTRY %main (p: f32[16]) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.1
}
"""
    row = step_totals(text).by_axis(MESH)
    assert list(row) == ["reduce-scatter"] and row["reduce-scatter"]["fsdp"] == {
        "count": 1, "bytes": 16, "sent_bytes": 48.0}  # a 4-float shard of 16 reduced over 4 devices
