"""What the writers send, shared by all of them: a record's numeric fields and the config as flat
hyperparameters. A module of its own so the writers need not import tracker.py, which imports them."""

from __future__ import annotations


def numeric(record: dict) -> dict[str, float]:
    """The record's numbers except the step (None, booleans and text left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config) -> dict[str, object]:
    """{'model.d_model': 256, ...}: hyperparameters as trackers take them."""
    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield prefix + key, value
    return dict(walk(config.to_dict(), ""))
