"""What the writers send, shared by all of them: a record's numeric fields and the config as flat
hyperparameters. A module of its own so the writers need not import tracker.py, which imports them."""

from __future__ import annotations


def numeric(record: dict) -> dict[str, float]:
    """The record's numbers except the step (None, booleans and text left out); a list of
    numbers (moe_expert_load) as one number per index, `name/i`."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out = {}
    for k, v in record.items():
        if k != "step" and number(v):
            out[k] = float(v)
        elif isinstance(v, list) and v and all(number(x) for x in v):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
    return out


def flat_config(config) -> dict[str, object]:
    """{'model.d_model': 256, ...}: hyperparameters as trackers take them."""
    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield prefix + key, value
    return dict(walk(config.to_dict(), ""))
