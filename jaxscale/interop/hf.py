"""Hugging Face weights in and out: the families of interop.hf_names.TABLES (their *ForCausalLM;
GPT-2's GPT2LMHeadModel), mixtures of experts with one tensor per expert as their checkpoints store them.

Both directions keep host memory near one tensor (loading) or one shard (saving): tensors are
read and written one at a time, and stacked layer parameters one layer slice at a time.
The logits of the imported or exported model match the source model's (tests/test_interop.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxscale.errors import ConfigError
from jaxscale.interop import hf_files, stacked
from jaxscale.interop.hf_config import check_spec_matches, hf_config_from_spec, model_config_from_hf, read_hf_config
from jaxscale.interop.hf_names import (
    BASE_PREFIX,
    IGNORED_SUFFIXES,
    OTHER_PARTS,
    PREDICTION_COPIES,
    ROTARY_TAILS,
    STACKS,
    TEXT_MODEL_PREFIXES,
    Row,
    Spacing,
    deinterleave,
    hf_layer,
    hf_name,
    hf_part_sizes,
    hf_shape,
    holds_prediction,
    interleave,
    rows_for,
    to_hf,
    to_ours,
)
from jaxscale.models import LanguageModel

__all__ = ["model_config_from_hf", "load_hf_params", "save_hf"]

DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size ("5GB")


def load_hf_params(hf_dir, spec, shardings=None) -> dict:
    """Our parameter tree (same keys and shapes as LanguageModel(spec).init, float32) from an HF dir.

    `hf_dir` holds config.json and model.safetensors, or shards with model.safetensors.index.json.
    `spec` must agree with the checkpoint's config (model_config_from_hf gives the fields).
    `shardings`: an optional tree of NamedSharding matching the parameters; each array is created
    with its sharding (default: the default device). bf16/fp16 tensors are converted to float32.
    Raises ConfigError naming the field or tensor when the checkpoint does not fit `spec`.
    """
    check_spec_matches(spec, hf_dir)
    shapes = _param_shapes(spec)
    layer_shapes = _per_layer(shapes)
    place = flatten_dict(shardings, sep="/") if shardings is not None else dict.fromkeys(shapes)
    rows = rows_for(spec.family, set(shapes))
    rotary = _rotary(spec, read_hf_config(hf_dir).get("rope_interleave", True), shapes)
    params = {}
    with hf_files.CheckpointReader(hf_dir) as reader:
        names = _checkpoint_names(reader, rows, spec, shapes)
        for row in rows:
            for path, (start, stop) in zip(row.ours, _part_ranges(row, layer_shapes)):
                read = functools.partial(_read_param, reader, names, row, layer_shapes[path], start, stop,
                                         rotary.get(path, 0))
                params[path] = (stacked.assemble(read, shapes[path], place[path]) if row.stacked
                                else jax.device_put(read(None), place[path]))
    return unflatten_dict(params, sep="/")


def save_hf(params: dict, spec, out_dir, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write `params` (a tree shaped like LanguageModel(spec).init) as an HF checkpoint in out_dir.

    Writes config.json (its family's transformers config) and float32 safetensors: model.safetensors,
    or shards of at most max_shard_bytes (a bigger tensor gets a shard alone) plus
    model.safetensors.index.json. Removes safetensors files of an earlier save in out_dir, which
    transformers could otherwise pick up. Arrays may be sharded over this process's devices.
    Multi-token prediction modules (model.mtp_depth) are written where the family's checkpoints
    store them (DeepSeek-V3's, as the layers after the model's, each with its copies of the
    embedding and head), and left out elsewhere. Returns the safetensors paths written.
    """
    if not holds_prediction(spec.family):
        spec, params = dataclasses.replace(spec, mtp_depth=0), {k: v for k, v in params.items() if k != "mtp"}
    config = hf_config_from_spec(spec)  # refuse before anything is written
    flat = flatten_dict(params, sep="/")
    _check_tree(flat, spec)
    shapes = {path: tuple(x.shape) for path, x in flat.items()}
    layer_shapes = _per_layer(shapes)
    rows = rows_for(spec.family, set(flat))
    tensors = {**_export_order(rows, shapes, Spacing.of(spec)), **_prediction_copies(rows, spec)}
    sizes = {name: 4 * math.prod(hf_shape(row, layer_shapes)) for name, (row, *_) in tensors.items()}
    shards = hf_files.plan_shards(sizes, max_shard_bytes)
    files = hf_files.shard_file_names(len(shards))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_earlier_save(out)
    fetch, rotary = _LastLayer(flat), _rotary(spec, True, flat)
    for shard, file in zip(shards, files):
        hf_files.write_shard(out / file, {name: _hf_tensor(fetch, rotary, *tensors[name]) for name in shard})
    if len(shards) > 1:
        hf_files.write_index(out, {name: file for shard, file in zip(shards, files) for name in shard},
                             sum(sizes.values()))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / file for file in files]


def _rotary(spec, interleaved: bool, paths) -> dict[str, int]:
    """Of the parameter `paths`, path -> the width of the rotary tail HF stores in interleaved
    pairs (DeepSeek's rope_interleave: the latent attention's query and rotary key,
    interop.hf_names.deinterleave)."""
    if not (spec.mla.on and interleaved):
        return {}
    return {path: spec.mla.rope_head_dim for path in paths if path.endswith(ROTARY_TAILS)}


def _read_param(reader, names, row: Row, shape, start, stop, rotary: int, layer: int | None):
    """One parameter (its layer `layer` when stacked) from the checkpoint, in our shape, float32:
    an experts row's from one HF tensor per expert; a rotary tail of `rotary` dimensions (0: none)
    put in our order."""
    if rotary:
        return deinterleave(_read_param(reader, names, row, shape, start, stop, 0, layer), rotary)
    if not row.experts:
        return to_ours(reader.read(names[row, layer][0], row.out_axis, start, stop), row, shape)
    return np.stack([to_ours(reader.read(name, row.out_axis, start, stop), row, shape[1:])
                     for name in names[row, layer]])


def _param_shapes(spec) -> dict[str, tuple[int, ...]]:
    """'a/b' path -> shape of every parameter the model built from `spec` has."""
    return {path: tuple(s.shape) for path, s in flatten_dict(LanguageModel(spec).shapes, sep="/").items()}


def _per_layer(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes with the leading dimension of stacked parameters (hf_names.STACKS) dropped."""
    return {path: shape[1:] if path.startswith(STACKS) else shape for path, shape in shapes.items()}


def _layers(row: Row, shapes: dict[str, tuple[int, ...]]) -> range | tuple[None]:
    """Our slices of the row's parameter: each layer of its stack, or None when unstacked."""
    return range(shapes[row.ours[0]][0]) if row.stacked else (None,)


def _experts(row: Row, shapes: dict[str, tuple[int, ...]]) -> range | tuple[None]:
    """The experts of an experts row (one HF tensor each), or None for a row of one tensor a layer."""
    return range(shapes[row.ours[0]][1]) if row.experts else (None,)


def _part_ranges(row: Row, layer_shapes) -> list[tuple[int | None, int | None]]:
    """[start, stop) of each of the row's parameters along HF's output axis; (None, None) when unfused."""
    if len(row.ours) == 1:
        return [(None, None)]
    ends = [0]
    for size in hf_part_sizes(row, layer_shapes):
        ends.append(ends[-1] + size)
    return list(zip(ends[:-1], ends[1:]))


def _checkpoint_names(reader, rows, spec, shapes) -> dict[tuple[Row, int | None], tuple[str, ...]]:
    """(row, layer) -> the checkpoint's tensor names (one; an experts row's one an expert), after
    checking each shape and that nothing is left over."""
    names, layer_shapes = {}, _per_layer(shapes)
    for row in rows:
        expected = hf_shape(row, layer_shapes)
        for layer in _layers(row, shapes):
            found = tuple(_find(reader, hf_name(row, layer, Spacing.of(spec), expert), BASE_PREFIX[spec.family])
                          for expert in _experts(row, shapes))
            for name in found:
                if reader.shape(name) != expected:
                    raise ConfigError("tensor", name, f"has shape {reader.shape(name)} but its config.json implies "
                                                      f"{expected}; the checkpoint does not match its config")
            names[row, layer] = found
    _refuse_leftovers(set(reader.files) - {name for found in names.values() for name in found}, spec)
    return names


def _find(reader, name: str, prefix: str) -> str:
    """`name`, or the same without the base-model prefix (checkpoints saved from GPT2Model/LlamaModel),
    or under a multimodal checkpoint's text model (TEXT_MODEL_PREFIXES)."""
    bare = name.removeprefix(prefix)
    for candidate in (name, bare, *(text + bare for text in TEXT_MODEL_PREFIXES if name.startswith(prefix))):
        if candidate in reader.files:
            return candidate
    raise ConfigError("tensor", name, f"is missing from the checkpoint in {reader.dir}")


def _refuse_leftovers(leftover: set[str], spec) -> None:
    """A tensor we have no parameter for would be dropped silently: refuse it unless it holds none."""
    tied_head = {"lm_head.weight"} if spec.tie_embeddings else set()  # some tied checkpoints store the copy
    unknown = sorted(n for n in leftover if not n.endswith(IGNORED_SUFFIXES) and n not in tied_head
                     and not n.startswith(OTHER_PARTS) and not _prediction_module(n, spec))
    if unknown:
        raise ConfigError("tensor", unknown[0], f"jaxscale's {spec.family} has no parameter for it ({len(unknown)} "
                                                f"such tensor(s)); this checkpoint is not a plain {spec.family}")


def _prediction_module(name: str, spec) -> bool:
    """A tensor of a DeepSeek-V3 checkpoint's multi-token prediction modules (its layers past
    num_hidden_layers) that is not imported: the modules past model.mtp_depth, and every
    module's copies of the embedding and head (the modules share the model's)."""
    found = re.fullmatch(r"model\.layers\.(\d+)\..*", name)
    return holds_prediction(spec.family) and found is not None and int(found.group(1)) >= spec.num_layers


def _check_tree(flat: dict, spec) -> None:
    expected = _param_shapes(spec)
    for path in sorted(set(expected) | set(flat)):
        got = tuple(flat[path].shape) if path in flat else None
        if got != expected.get(path):
            raise ValueError(f"params[{path!r}] has shape {got} but the model of `spec` has {expected.get(path)}")


def _export_order(rows, shapes: dict[str, tuple[int, ...]], spacing: Spacing) -> dict[str, tuple]:
    """HF name -> (row, our layer, expert): unstacked tensors first, then HF's layers in order, so
    shards follow depth."""
    order = [(row, layer, expert) for row in rows for layer in _layers(row, shapes) for expert in _experts(row, shapes)]
    order.sort(key=lambda item: -1 if item[1] is None else hf_layer(item[0], item[1], spacing))
    return {hf_name(row, layer, spacing, expert): (row, layer, expert) for row, layer, expert in order}


def _prediction_copies(rows, spec) -> dict[str, tuple]:
    """HF name -> (row, None, None) of each prediction module's copies of the embedding and the
    head (hf_names.PREDICTION_COPIES; a tied head is the embedding)."""
    unstacked = {row.ours[0]: row for row in rows if not row.stacked}
    return {name.format(i=spec.num_layers + k): (unstacked.get(ours, unstacked["embed"]), None, None)
            for k in range(spec.mtp_depth) for name, ours in PREDICTION_COPIES.items()}


class _LastLayer:
    """stacked.fetch of one parameter slice, keeping the last one fetched: a layer's experts are
    written one tensor each from one fetch."""

    def __init__(self, flat: dict):
        self.flat, self.key, self.value = flat, None, None

    def __call__(self, path: str, layer: int | None) -> np.ndarray:
        if self.key != (path, layer):
            self.key, self.value = (path, layer), stacked.fetch(self.flat[path], layer)
        return self.value


def _hf_tensor(fetch: _LastLayer, rotary: dict[str, int], row: Row, layer: int | None, expert: int | None):
    """The row's HF tensor for `layer` (and `expert`), fetched one parameter slice at a time
    (fused parts concatenated; rotary tails, `_rotary`, interleaved)."""
    def ours(path):
        value = fetch(path, layer) if expert is None else fetch(path, layer)[expert]
        return interleave(value, rotary[path]) if path in rotary else value

    parts = [to_hf(ours(path), row) for path in row.ours]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=row.out_axis)


_OUR_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _remove_earlier_save(out: Path) -> None:
    for path in out.iterdir():
        if _OUR_FILES.fullmatch(path.name):
            path.unlink()
