"""The data pipeline's settings, read once from the run config and checked.

Reading through this one place means the rest of the package never touches the ConfigDict, and
every bad value is reported as a ConfigError naming its field before any file is opened. The
checks here are the only ones on `data.*` (and `train.seed`, whose range is Grain's);
`jaxscale.validate` runs them with the rest. Defaults live in `jaxscale.config.defaults()`:
pass a config built from it.
"""

from __future__ import annotations

import dataclasses

from jaxscale.errors import require, require_choice
from jaxscale.names import SOURCES, TOKEN_DTYPES


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Everything make_data reads. `source` is resolved: never 'auto'."""

    source: str
    path: str
    tokenizer: str
    text_field: str
    token_dtype: str
    val_fraction: float
    num_threads: int
    document_mask: bool
    seq_len: int
    global_batch: int
    seed: int
    vocab_size: int


# The DataSettings fields read as they are from config.data.
_DATA_FIELDS = ("source", "path", "tokenizer", "text_field", "token_dtype", "val_fraction", "num_threads",
                "document_mask")


def check(config) -> None:
    """config.data (and train.seed) are usable; raises ConfigError naming the field and the fix."""
    d = config.data
    require_choice("data.source", d.source, SOURCES)
    require(d.source in ("auto", "file") or not d.path, "data.source", d.source,
            "data.path is set: use data.source=file (or auto), or clear data.path")
    require(d.source != "file" or bool(d.path), "data.path", d.path, "data.source=file needs --config.data.path=FILE")
    require(d.num_threads >= 0, "data.num_threads", d.num_threads, "must be >= 0 (0 reads in the training thread)")
    require(0.0 < d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be between 0 and 1 (exclusive)")
    require(0 <= config.train.seed < 2**32, "train.seed", config.train.seed,
            "use an integer in [0, 2**32)")  # Grain's range
    require(d.token_dtype in TOKEN_DTYPES, "data.token_dtype", d.token_dtype,
            "use uint16 (vocab <= 65536, nanoGPT's default) or uint32")


def read_settings(config) -> DataSettings:
    """Checked DataSettings from config.data / config.train / config.model, with source resolved
    (auto: file if data.path is set, else embedded). `config` must have every data.* field."""
    check(config)
    data = {key: config.data[key] for key in _DATA_FIELDS}
    if data["source"] == "auto":
        data["source"] = "file" if data["path"] else "embedded"
    t = config.train
    return DataSettings(**data, seq_len=int(t.seq_len), global_batch=int(t.global_batch_size),
                        seed=int(t.seed), vocab_size=int(config.model.vocab_size))
