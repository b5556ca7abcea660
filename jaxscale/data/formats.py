"""The files a corpus comes in, read as a stream of text, and cut into units of work.

Inputs are named by comma-separated files, directories and globs (`expand`). A unit is a byte
range of an uncompressed JSON-lines file (line-aligned: a unit reads the lines that start inside
it), a run of Parquet row groups, or a whole file (text, compressed JSON lines, one Arrow file of
a Hugging Face dataset saved with `save_to_disk`). Reading a unit yields pieces: (text, whether
the piece ends a document, bytes of the unit read so far). Nothing holds a whole file: a text
file, which is one document, comes in line-aligned pieces of about a megabyte.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from jaxscale.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md")  # other suffixes are read as text too, if they look like text
# name ending -> kind; the longest endings first. '.json' is read as JSON lines, one object a line.
KINDS = ((".jsonl.gz", "jsonl.gz"), (".json.gz", "jsonl.gz"), (".jsonl.zst", "jsonl.zst"),
         (".json.zst", "jsonl.zst"), (".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"),
         (".arrow", "arrow"), (".bin", "tokens"), (".npy", "tokens"), (".txt", "text"), (".md", "text"))
SUPPORTED = ("use .txt/.md (text), .jsonl/.json (+ .gz/.zst) or .parquet (documents), a Hugging Face dataset "
             "directory (save_to_disk), a token store (python -m jaxscale.prepare) or .bin/.npy (token ids)")
TEXT_CHUNK = 1 << 20      # bytes of a text file read at once (then up to the line's end)
PARQUET_ROWS = 1024       # rows read from Parquet at once
PATH, TEXT_FIELD = "data.path", "data.text_field"  # the fields errors name (prepare renames them)


Piece = tuple[str, bool, int]  # (text, ends a document, bytes of the unit read so far)


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit of work: `start:stop` are bytes (jsonl) or row groups (parquet), else the whole file;
    `size` is the input bytes it covers."""

    path: str
    kind: str
    start: int
    stop: int
    size: int


def kind_of(path: Path) -> str:
    name = path.name.lower()
    return next((kind for ending, kind in KINDS if name.endswith(ending)), "text")


# --- naming inputs ---------------------------------------------------------------------------

def expand(spec: str, field: str = PATH) -> list[Path]:
    """The files (and token-store directories) that comma-separated files, directories and globs
    name, in the order given, each directory and glob sorted. ConfigError(field) for a name that
    matches nothing."""
    entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
    if not entries:
        raise ConfigError(field, spec, f"names no input; {SUPPORTED}")
    return [path for entry in entries for path in _entry(entry, field)]


def _entry(entry: str, field: str) -> list[Path]:
    if glob.has_magic(entry):
        matches = sorted(glob.glob(os.path.expanduser(entry), recursive=True))
        if not matches:
            raise ConfigError(field, entry, "matches no files; check the pattern (quote it so the shell leaves it)")
        return [path for match in matches for path in _entry(match, field)]
    path = Path(entry).expanduser()
    if path.is_dir():
        return _directory(path, field)
    if not path.is_file():
        raise ConfigError(field, entry, f"no such file or directory; {SUPPORTED}")
    return [path]


def _directory(path: Path, field: str) -> list[Path]:
    """A token store or a dataset as itself; else every supported file under it, sorted."""
    if (path / "manifest.json").is_file():
        return [path]  # a token store: the caller reads it whole
    if (path / "state.json").is_file():
        return _hf_dataset_files(path, field)
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ConfigError(field, str(path), f"is a Hugging Face DatasetDict; name one split's directory ({splits})")
    known = tuple(ending for ending, _ in KINDS)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(known)
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(field, str(path), f"holds no supported files; {SUPPORTED}")
    return files


def _hf_dataset_files(path: Path, field: str) -> list[Path]:
    """The Arrow files of a dataset saved with `datasets.Dataset.save_to_disk`, in order."""
    try:
        names = [entry["filename"] for entry in json.loads((path / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(field, str(path), f"state.json does not list the data files ({error!r}); "
                          "save the dataset with Dataset.save_to_disk") from None
    return [path / name for name in names]


# --- cutting files into units ----------------------------------------------------------------

def units(path: Path, unit_bytes: int) -> list[Unit]:
    """`path` cut into units of about unit_bytes input bytes (at least one unit per file)."""
    kind, size = kind_of(path), path.stat().st_size
    if kind == "jsonl":
        starts = range(0, max(size, 1), unit_bytes)
        return [Unit(str(path), kind, a, min(a + unit_bytes, size), min(a + unit_bytes, size) - a) for a in starts]
    if kind == "parquet":
        return _parquet_units(path, unit_bytes)
    return [Unit(str(path), kind, 0, size, size)]


def _parquet_units(path: Path, unit_bytes: int) -> list[Unit]:
    metadata = _parquet_file(path).metadata
    sizes = [metadata.row_group(g).total_byte_size for g in range(metadata.num_row_groups)]
    cuts, total = [0], 0
    for group, size in enumerate(sizes):
        total += size
        if total >= unit_bytes and group + 1 < len(sizes):
            cuts.append(group + 1)
            total = 0
    cuts.append(len(sizes))
    return [Unit(str(path), "parquet", a, b, sum(sizes[a:b])) for a, b in zip(cuts, cuts[1:])]


# --- reading units ---------------------------------------------------------------------------

def read(unit: Unit, text_field: str) -> Iterator[Piece]:
    """The unit's text as pieces; ConfigError naming data.path / data.text_field for bad content."""
    return _READERS[unit.kind](unit, text_field)


def whole_file(path: Path) -> Unit:
    """All of `path` as one unit."""
    return units(path, sys.maxsize)[0]


def _json_record(line: bytes, path: str, where: str) -> dict | None:
    """One JSON-lines record (None for a blank line)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as error:
        raise ConfigError(PATH, path, f"{where} is not JSON ({error}); give one object per line") from None
    if not isinstance(record, dict):
        raise ConfigError(PATH, path, f"{where} is a JSON {type(record).__name__}; give one object per line")
    return record


def _record_text(line: bytes, field: str, path: str, where: str) -> str | None:
    """The text field of one JSON-lines record (None for a blank line)."""
    record = _json_record(line, path, where)
    if record is None:
        return None
    if field not in record:
        raise ConfigError(TEXT_FIELD, field, f"{where} of {path} has keys {sorted(record)}; name the text key")
    return _text_value(record[field], f"{where} of {path}", field)


def _text_value(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(TEXT_FIELD, field, f"{where} holds {type(value).__name__}, not text; name a string field")
    return value


def _jsonl_range(unit: Unit, field: str) -> Iterator[Piece]:
    with open(unit.path, "rb") as lines:
        if unit.start:  # the line that starts before this unit belongs to the previous one
            lines.seek(unit.start - 1)
            lines.readline()
        while (at := lines.tell()) < unit.stop and (line := lines.readline()):
            text = _record_text(line, field, unit.path, f"the line at byte {at}")
            if text is not None:
                yield text, True, lines.tell() - unit.start


def _decompressed(raw, kind: str, path: str):
    if kind == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw)
    try:
        import zstandard
    except ImportError:
        raise ConfigError(PATH, path, "a .zst file needs the zstandard package: pip install 'jaxscale[zstd]'") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))


def _jsonl_compressed(unit: Unit, field: str) -> Iterator[Piece]:
    with open(unit.path, "rb") as raw:
        try:
            for number, line in enumerate(_decompressed(raw, unit.kind, unit.path), 1):
                text = _record_text(line, field, unit.path, f"line {number}")
                if text is not None:
                    yield text, True, raw.tell()
        except (OSError, EOFError) as error:  # gzip's BadGzipFile is an OSError; zstandard's ZstdError too
            raise ConfigError(PATH, unit.path, f"cannot be decompressed ({error}); re-create the file") from None


def _parquet_file(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(PATH, str(path), "Parquet needs pyarrow: pip install 'jaxscale[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 -- pyarrow raises ArrowInvalid, OSError, ...
        raise ConfigError(PATH, str(path), f"not a readable Parquet file ({error})") from None


def _parquet(unit: Unit, field: str) -> Iterator[Piece]:
    parquet = _parquet_file(unit.path)
    if field not in parquet.schema_arrow.names:
        raise ConfigError(TEXT_FIELD, field, f"{unit.path} has columns {parquet.schema_arrow.names}; "
                          "name the text column")
    done = 0
    for group in range(unit.start, unit.stop):
        for batch in parquet.iter_batches(batch_size=PARQUET_ROWS, row_groups=[group], columns=[field]):
            for value in batch.column(0).to_pylist():
                yield _text_value(value, f"a row of {unit.path}", field), True, done
        done += parquet.metadata.row_group(group).total_byte_size


def _arrow_reader(source, path: str):
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid as error:
        raise ConfigError(PATH, path, f"not an Arrow stream ({error}); save the dataset with "
                          "Dataset.save_to_disk") from None


def _arrow(unit: Unit, field: str) -> Iterator[Piece]:
    import pyarrow as pa

    with pa.OSFile(unit.path) as source:  # read, not memory-mapped: resident memory stays one batch
        reader = _arrow_reader(source, unit.path)
        if field not in reader.schema.names:
            raise ConfigError(TEXT_FIELD, field, f"{unit.path} has columns {reader.schema.names}; "
                              "name the text column")
        for batch in reader:
            for value in batch.column(field).to_pylist():
                yield _text_value(value, f"a row of {unit.path}", field), True, source.tell()


RECORD_KINDS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow")  # the formats that hold records


def records(path: Path) -> Iterator[tuple[dict, str]]:
    """(record, where it is) of a file of RECORD_KINDS, in order: each JSON line's object, or
    each table row as a dict (all its columns)."""
    kind = kind_of(path)
    if kind == "parquet":
        yield from _rows(_parquet_file(path).iter_batches(batch_size=PARQUET_ROWS), path)
    elif kind == "arrow":
        import pyarrow as pa

        with pa.OSFile(str(path)) as source:
            yield from _rows(_arrow_reader(source, str(path)), path)
    else:
        with open(path, "rb") as raw:
            lines = raw if kind == "jsonl" else _decompressed(raw, kind, str(path))
            for number, line in enumerate(lines, 1):
                if (record := _json_record(line, str(path), f"line {number}")) is not None:
                    yield record, f"line {number} of {path}"


def _rows(batches, path: Path) -> Iterator[tuple[dict, str]]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield record, f"row {row} of {path}"


def _looks_binary(path: Path) -> bool:
    # NUL bytes do not occur in real text but fill compressed and binary formats.
    with open(path, "rb") as head:
        return b"\0" in head.read(1 << 16)


def _text(unit: Unit, field: str) -> Iterator[Piece]:
    """One document, in pieces that end at line ends (so no character is split)."""
    path = Path(unit.path)
    if path.suffix not in TEXT_SUFFIXES and _looks_binary(path):
        raise ConfigError(PATH, unit.path, f"unknown extension {path.suffix!r} and not text; {SUPPORTED}")
    with open(path, "rb") as text:
        while chunk := text.read(TEXT_CHUNK) + text.readline():
            yield chunk.decode("utf-8", errors="replace"), False, text.tell()
        yield "", True, text.tell()


def _tokens(unit: Unit, field: str) -> Iterator[Piece]:
    raise ConfigError(PATH, unit.path, "holds token ids already; give it to data.path as it is")


_READERS = {"jsonl": _jsonl_range, "jsonl.gz": _jsonl_compressed, "jsonl.zst": _jsonl_compressed,
            "parquet": _parquet, "arrow": _arrow, "text": _text, "tokens": _tokens}
