"""The data pipeline's settings, read once from the run config and checked.

Reading through this one place means the rest of the package never touches the ConfigDict, and
every bad value is reported as a ConfigError naming its field before any file is opened. The
checks here are the only ones on `data.*` (and `train.seed`, whose range is Grain's);
`jaxscale.validate` runs them with the rest. Defaults live in `jaxscale.config.defaults()`:
pass a config built from it.
"""

from __future__ import annotations

import dataclasses
import re

from jaxscale.errors import ConfigError, require, require_choice
from jaxscale.names import SOURCES, TOKEN_DTYPES, TRAIN_ON


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Everything make_data reads. `source` is resolved: never 'auto'."""

    source: str
    path: str
    mixture: tuple[tuple[str, str, float], ...]  # (name, path, weight) per source; () without a mixture
    tokenizer: str
    text_field: str
    token_dtype: str
    val_fraction: float
    num_threads: int
    document_mask: bool
    chat_template: str
    train_on: str
    pairs: bool          # preference tuning (preference.loss): the data are preference pairs (jaxscale.data.pairs)
    seq_len: int
    global_batch: int
    seed: int
    vocab_size: int


# The DataSettings fields read as they are from config.data.
_DATA_FIELDS = ("source", "path", "tokenizer", "text_field", "token_dtype", "val_fraction", "num_threads",
                "document_mask", "chat_template", "train_on")


MIXTURE_FORM = "write data.mixture as NAME=PATH:WEIGHT,... (e.g. web=stores/web:0.7,code=stores/code:0.3)"


def parse_mixture(text: str) -> tuple[tuple[str, str, float], ...]:
    """data.mixture's (name, path, weight) entries; ConfigError(data.mixture) naming the bad one."""
    entries = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, equals, rest = entry.partition("=")
        path, colon, weight_text = rest.rpartition(":")
        require(bool(equals and colon and path) and re.fullmatch(r"[A-Za-z_][\w.-]*", name) is not None,
                "data.mixture", entry, MIXTURE_FORM)
        try:
            weight = float(weight_text)
        except ValueError:
            raise ConfigError("data.mixture", entry, f"the weight {weight_text!r} is not a number; "
                              f"{MIXTURE_FORM}") from None
        require(weight > 0 and weight != float("inf"), "data.mixture", entry,
                f"the weight must be positive and finite; drop a source rather than weighting it {weight_text}")
        require(name not in (e[0] for e in entries), "data.mixture", entry, f"{name} is named twice; name each once")
        entries.append((name, path, weight))
    return tuple(entries)


def check(config) -> None:
    """config.data (and train.seed) are usable; raises ConfigError naming the field and the fix."""
    d = config.data
    require_choice("data.source", d.source, SOURCES)
    require_choice("data.train_on", d.train_on, TRAIN_ON)
    require(d.source in ("auto", "file") or not (d.path or d.mixture), "data.source", d.source,
            "data.path or data.mixture is set: use data.source=file (or auto), or clear them")
    require(not (d.path and d.mixture), "data.mixture", d.mixture, "data.path is set too; use one of them")
    require(d.source != "file" or bool(d.path or d.mixture), "data.path", d.path,
            "data.source=file needs --config.data.path=FILE (or data.mixture)")
    parse_mixture(d.mixture)
    require(d.num_threads >= 0, "data.num_threads", d.num_threads, "must be >= 0 (0 reads in the training thread)")
    require(0.0 < d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be between 0 and 1 (exclusive)")
    require(0 <= config.train.seed < 2**32, "train.seed", config.train.seed,
            "use an integer in [0, 2**32)")  # Grain's range
    require(d.token_dtype in TOKEN_DTYPES, "data.token_dtype", d.token_dtype,
            "use uint16 (vocab <= 65536, nanoGPT's default) or uint32")
    require(config.preference.loss == "none" or bool(d.path), "preference.loss", config.preference.loss,
            "preference tuning reads pairs of completions: set --config.data.path=PAIRS.jsonl (records with prompt, "
            "chosen and rejected)")


def read_settings(config) -> DataSettings:
    """Checked DataSettings from config.data / config.train / config.model, with source resolved
    (auto: file if data.path or data.mixture is set, else embedded). `config` must have every data.* field."""
    check(config)
    data = {key: config.data[key] for key in _DATA_FIELDS}
    if data["source"] == "auto":
        data["source"] = "file" if data["path"] or config.data.mixture else "embedded"
    t, vocab = config.train, int(config.model.vocab_size)
    return DataSettings(**data, mixture=parse_mixture(config.data.mixture), pairs=config.preference.loss != "none",
                        seq_len=int(t.seq_len), global_batch=int(t.global_batch_size), seed=int(t.seed),
                        vocab_size=vocab)
