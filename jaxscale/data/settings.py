"""The data pipeline's settings, read once from the run config and checked.

Reading through this one place means the rest of the package never touches the ConfigDict,
a minimal config (only some `data.*` fields) still works, and every bad value is reported
as a ConfigError naming its field before any file is opened.
"""

from __future__ import annotations

import dataclasses

from jaxscale.errors import ConfigError

SOURCES = ("auto", "embedded", "synthetic", "file")
TOKEN_DTYPES = ("uint16", "uint32")
DEFAULTS = {"source": "auto", "path": "", "tokenizer": "bytes", "text_field": "text",
            "token_dtype": "uint16", "val_fraction": 0.05, "num_threads": 2}


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
    seq_len: int
    global_batch: int
    seed: int
    vocab_size: int


def _require(ok: bool, field: str, value, fix: str) -> None:
    if not ok:
        raise ConfigError(field, value, fix)


def _resolve_source(source: str, path: str) -> str:
    _require(source in SOURCES, "data.source", source, f"choose one of {', '.join(SOURCES)}")
    if source == "auto":
        return "file" if path else "embedded"
    _require(source != "file" or bool(path), "data.path", path, "data.source=file needs data.path=FILE")
    return source


def _check(s: DataSettings) -> None:
    for field, value in (("train.seq_len", s.seq_len), ("train.global_batch_size", s.global_batch),
                         ("model.vocab_size", s.vocab_size)):
        _require(value > 0, field, value, "must be > 0")
    _require(s.num_threads >= 0, "data.num_threads", s.num_threads,
             "must be >= 0 (0 reads in the training thread)")
    _require(0.0 < s.val_fraction < 1.0, "data.val_fraction", s.val_fraction,
             "must be in (0, 1); 0.05 holds out the last 5% of tokens for validation")
    _require(0 <= s.seed < 2**32, "train.seed", s.seed, "use an integer in [0, 2**32)")  # Grain's range
    _require(s.token_dtype in TOKEN_DTYPES, "data.token_dtype", s.token_dtype,
             "use uint16 (vocab <= 65536, nanoGPT's default) or uint32")


def read_settings(config) -> DataSettings:
    """DataSettings from config.data / config.train / config.model; missing data.* fields take DEFAULTS."""
    data = {key: config.data.get(key, default) for key, default in DEFAULTS.items()}
    data["source"] = _resolve_source(data["source"], data["path"])
    t = config.train
    settings = DataSettings(**data, seq_len=int(t.seq_len), global_batch=int(t.global_batch_size),
                            seed=int(t.seed), vocab_size=int(config.model.vocab_size))
    _check(settings)
    return settings
