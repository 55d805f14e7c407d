"""Faults a helper found in the text data pipeline: duplicate rows falling on both sides of the
held-out split without a word, and a long text whose first 64 Ki characters are whitespace cut
to nothing and trained on as an empty sample."""

import json

from tightfit.data import (MAX_TEXT_CHARS, TextClassificationData, check_split, held_out_split,
                           load_text_classification)


def _part(data, idx):
    return TextClassificationData([data.texts[i] for i in idx], [data.labels[i] for i in idx], data.label_names,
                                  data.source)


def test_held_out_texts_that_are_also_training_texts_are_noted():
    """150 texts, each in two rows, random labels: 24 of 30 held-out rows were training rows too,
    and the held-out accuracy (0.87 on random labels) looked like learning; the run said nothing."""
    texts = [f"review number {i} of the film" for i in range(150)] * 2
    data = TextClassificationData(texts, [i % 2 for i in range(300)], ["neg", "pos"], "dup.csv")
    train, held = held_out_split(len(data))
    notes = check_split(data, _part(data, train), _part(data, held))
    seen = {texts[i] for i in train}
    copies = sum(texts[i] in seen for i in held)
    assert copies > 0
    assert [n for n in notes if "word for word" in n] == [
        f"{copies} held-out samples ({copies / len(held):.1%}) also appear word for word among the training samples "
        "(duplicate rows in the data): the held-out accuracy counts them as unseen"]
    unique = TextClassificationData([f"review {i}" for i in range(300)], [i % 2 for i in range(300)], ["neg", "pos"], "u")
    assert not [n for n in check_split(unique, _part(unique, train), _part(unique, held)) if "word for word" in n]


def test_a_text_that_is_whitespace_up_to_the_cut_keeps_its_words(tmp_path):
    """70,000 spaces then the review: the cut at 64 Ki characters left only spaces, the blank check had
    passed on the whole text, and the sample trained as [CLS] [SEP]."""
    rows = [{"text": " " * 70_000 + f"great movie number {i}", "label": "pos" if i % 2 else "neg"} for i in range(4)]
    rows += [{"text": f"short review {i}", "label": "neg"} for i in range(4)]
    (tmp_path / "ws.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    data = load_text_classification(tmp_path / "ws.jsonl")
    assert data.texts[:4] == [f"great movie number {i}" for i in range(4)]
    assert data.texts[4:] == [f"short review {i}" for i in range(4)]  # texts under the cut are as written
    assert all(len(t) <= MAX_TEXT_CHARS for t in data.texts)


def test_two_integer_labels_past_float_precision_are_two_classes(tmp_path):
    """9007199254740992 and 9007199254740993 (ids as labels) were refused as "the same number written
    two ways": compared as floats, they are equal. 1 and 1.0 are still one number written two ways."""
    import pytest

    from tightfit.errors import TightfitError

    big = ["9007199254740992", "9007199254740993"]
    (tmp_path / "big.csv").write_text("text,label\n" + "".join(f"review {i},{big[i % 2]}\n" for i in range(10)))
    assert load_text_classification(tmp_path / "big.csv").label_names == big
    (tmp_path / "one.csv").write_text("text,label\n" + "".join(f"review {i},{['1', '1.0'][i % 2]}\n" for i in range(10)))
    with pytest.raises(TightfitError, match="same number written two ways"):
        load_text_classification(tmp_path / "one.csv")


def test_a_text_under_two_labels_is_noted():
    texts = [f"review number {i} of the film" for i in range(40)] + ["review number 3 of the film"]
    data = TextClassificationData(texts, [i % 2 for i in range(40)] + [0], ["neg", "pos"], "two.csv")
    train, held = held_out_split(len(data))
    assert [n for n in check_split(data, _part(data, train), _part(data, held)) if "labels" in n] == [
        "1 text is in the data under two or more labels (e.g. 'review number 3 of the film' as 'pos' and as 'neg'): "
        "the model is taught both; correct the labels if one is wrong"]


def test_a_jsonl_text_with_half_a_surrogate_pair_is_refused_in_one_line(tmp_path, capsys):
    """A JSONL text holding "\\ud83d" alone (an emoji cut in two by an exporter) loaded as a Python
    string no UTF-8 holds; the tokenizer then ended `tightfit train` in a TypeError traceback. A
    whole pair ("\\ud83d\\ude00") is one character and loads."""
    import random

    import pytest

    from conftest import tiny_cpu_job
    from tightfit.cli import main
    from tightfit.errors import TightfitError

    job = tiny_cpu_job(tmp_path)
    rng = random.Random(0)
    rows = [f'{{"text": "film number {i} \\ud83d\\ude00", "label": "{rng.choice(["pos", "neg"])}"}}' for i in range(40)]
    (tmp_path / "whole.jsonl").write_text("\n".join(rows) + "\n")
    assert load_text_classification(tmp_path / "whole.jsonl").texts[0] == "film number 0 \U0001F600"
    rows[7] = '{"text": "good film \\ud83d", "label": "pos"}'
    (tmp_path / "half.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"row 8: the text holds '\\ud83d', half of a UTF-16 surrogate pair"):
        load_text_classification(tmp_path / "half.jsonl")
    out = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", str(tmp_path / "half.jsonl"), "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tightfit: error:")]
    assert len(errors) == 1 and "surrogate pair" in errors[0]
    assert not out.exists()


def test_a_byte_that_is_not_utf8_is_named_at_its_place_in_the_file(tmp_path):
    """A Latin-1 "é" past the first 8 KiB of a JSONL file was reported at a byte counted from the
    start of the chunk being decoded (6407 for the byte at 112903 here), and in a CSV with a BOM 3 bytes
    early: the user looked for it in the wrong place."""
    import gzip

    import pytest

    from tightfit.errors import TightfitError

    rows = b"".join(f'{{"text": "review {i}", "label": "{"ab"[i % 2]}"}}\n'.encode() for i in range(3000))
    bad = rows + '{"text": "caf\xe9", "label": "b"}\n'.encode("latin-1")
    at = bad.index(b"\xe9")
    for name, content in (("late.jsonl", bad), ("late.jsonl.gz", gzip.compress(bad)),
                          ("bom.csv", b"\xef\xbb\xbftext,label\n" + "caf\xe9,a\n".encode("latin-1"))):
        (tmp_path / name).write_bytes(content)
        where = at if name.startswith("late") else content.index(b"\xe9")
        with pytest.raises(TightfitError, match=f"cannot read as UTF-8 text \\(invalid continuation byte at byte "
                                                f"{where}\\)"):
            load_text_classification(tmp_path / name)


def test_a_bad_byte_past_the_first_mebibyte_is_named_where_it_is_and_a_character_cut_by_a_chunk_is_not(tmp_path):
    """The file is decoded again in chunks of 1 MiB (not read whole into memory): a character
    whose bytes straddle two chunks is not an error, and the byte named is counted from the file's start."""
    import pytest

    from tightfit.errors import TightfitError

    head = b"text,label\n"
    filler = b"".join(f"review {i},{'ab'[i % 2]}\n".encode() for i in range(200_000))
    cut = 2**20 - len(head) - 1  # the euro sign's 3 bytes begin 1 byte before the first chunk's end
    body = filler[:cut] + "\u20ac".encode() + filler[cut:]
    content = head + body + "caf\xe9,a\n".encode("latin-1")
    (tmp_path / "big.csv").write_bytes(content)
    at = content.index(b"\xe9")
    with pytest.raises(TightfitError, match=f"invalid continuation byte at byte {at}\\)"):
        load_text_classification(tmp_path / "big.csv")


def test_the_last_format_ending_of_the_name_says_how_the_file_is_read(tmp_path):
    """reviews.jsonl.csv (a CSV made from a JSON Lines file, named by appending .csv) was read as
    JSON Lines ("line 1 is not valid JSON"), and x.tsv.csv as tab-separated: any of the endings
    anywhere in the name counted, JSONL first, though the name ends in .csv."""
    import gzip

    rows = "".join(f"review {i},{'ab'[i % 2]}\n" for i in range(30))
    (tmp_path / "reviews.jsonl.csv").write_text("text,label\n" + rows)
    (tmp_path / "reviews.tsv.csv.gz").write_bytes(gzip.compress(("text,label\n" + rows).encode()))
    (tmp_path / "reviews.csv.jsonl").write_text("".join(
        f'{{"text": "review {i}", "label": "{"ab"[i % 2]}"}}\n' for i in range(30)))
    for name in ("reviews.jsonl.csv", "reviews.tsv.csv.gz", "reviews.csv.jsonl"):
        data = load_text_classification(tmp_path / name)
        assert (len(data), data.label_names, data.texts[1]) == (30, ["a", "b"], "review 1"), name


def test_an_indented_json_file_longer_than_what_the_error_reads_still_gets_the_hint(tmp_path, monkeypatch):
    """The error reads a bounded part of the file (data.SPREAD_READ_CHARS, 16 Mi characters): a
    json.dump(rows, f, indent=2) file longer than that lost its hint ("line 1 is not valid JSON"),
    though it is the usual file the hint is for. Here the bound is made small."""
    import pytest

    from tightfit import data
    from tightfit.errors import TightfitError

    monkeypatch.setattr(data, "SPREAD_READ_CHARS", 500)
    rows = [{"text": f"review {i}", "label": "ab"[i % 2]} for i in range(300)]
    (tmp_path / "data.json").write_text(json.dumps(rows, indent=2))
    with pytest.raises(TightfitError, match=r"line 1 begins a JSON array written over more than \d+ lines: JSON Lines"):
        load_text_classification(tmp_path / "data.json")


def test_a_json_file_written_with_indent_is_told_apart_from_broken_json(tmp_path):
    """data.json saved with json.dump(rows, f, indent=2) (the usual way to write one from Python)
    was refused as "line 1 is not valid JSON (Expecting value)", though the file is valid JSON:
    JSON Lines wants each object on one line. A line that is broken stays "not valid JSON"."""
    import pytest

    from tightfit.errors import TightfitError

    rows = [{"text": f"review {i}", "label": "ab"[i % 2]} for i in range(30)]
    (tmp_path / "data.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "pretty.jsonl").write_text("\n".join(json.dumps(r, indent=2) for r in rows))
    for name, shape in (("data.json", "array written over 122 lines"), ("pretty.jsonl", "object written over 4 lines")):
        with pytest.raises(TightfitError, match=f"line 1 begins a JSON {shape}: JSON Lines holds one object per line"):
            load_text_classification(tmp_path / name)
    (tmp_path / "broken.jsonl").write_text(json.dumps(rows[0]) + '\n{"text": "a" "label": "b"}\n' + json.dumps(rows[1]))
    with pytest.raises(TightfitError, match=r"line 2 is not valid JSON \(Expecting ',' delimiter\)$"):
        load_text_classification(tmp_path / "broken.jsonl")


def test_blank_lines_before_a_csv_header_are_skipped_as_blank_lines_between_records_are(tmp_path):
    """A CSV or TSV beginning with a blank line (a file written with a leading newline; pandas reads it)
    was refused as "record 1 has 2 fields, the header has 0": the blank line was taken for the
    header. Blank lines between records were already skipped; those before the header are too, and
    a file of blank lines only is empty."""
    import pytest

    from tightfit.errors import TightfitError

    rows = "".join(f"review {i},{'ab'[i % 2]}\n" for i in range(30))
    for name, content in (("lead.csv", "\n\ntext,label\n" + rows), ("lead.tsv", "\r\ntext\tlabel\r\n" +
                                                                     rows.replace(",", "\t").replace("\n", "\r\n"))):
        (tmp_path / name).write_text(content, newline="")
        data = load_text_classification(tmp_path / name)
        assert (len(data), data.label_names, data.texts[1]) == (30, ["a", "b"], "review 1"), name
    (tmp_path / "late.csv").write_text("\n\ntext,label\n" + rows.replace("review 3,", "review 3,a,"))
    with pytest.raises(TightfitError, match="record 4 has 3 fields, the header has 2$"):
        load_text_classification(tmp_path / "late.csv")
    (tmp_path / "open.csv").write_text('\ntext,label\nreview 0,a\n"review 1,b\n')
    with pytest.raises(TightfitError, match=r"malformed CSV at record 2, from line 4 \(a quote opened"):
        load_text_classification(tmp_path / "open.csv")
    (tmp_path / "blank.csv").write_text("\n\n\n")
    with pytest.raises(TightfitError, match="blank.csv: empty file$"):
        load_text_classification(tmp_path / "blank.csv")
    (tmp_path / "header.csv").write_text('\n\n"text,label\nreview 0,a\n')
    with pytest.raises(TightfitError, match=r"malformed CSV at the header, from line 3 \(a quote opened"):
        load_text_classification(tmp_path / "header.csv")


def test_a_jsonl_nan_is_blank_in_the_text_column_as_in_the_label_column(tmp_path):
    """JSON Lines NaN (json.dumps of a float('nan'): a missing value of a table) was a blank label
    but a text: the row trained as the review 'nan'. It is skipped as blank, as null is."""
    rows = [json.dumps({"text": f"review {i}", "label": "ab"[i % 2]}) for i in range(30)]
    rows[4] = '{"text": NaN, "label": "a"}'
    rows[5] = '{"text": null, "label": "b"}'
    (tmp_path / "nan.jsonl").write_text("\n".join(rows) + "\n")
    data = load_text_classification(tmp_path / "nan.jsonl")
    assert (len(data), data.skipped_blank, "nan" in data.texts) == (28, 2, False)


def test_a_jsonl_line_python_cannot_hold_is_one_line_not_a_traceback(tmp_path, capsys):
    """An integer of more than 4,300 digits (Python's limit on reading one) or arrays nested
    deeper than Python's recursion limit: json.loads raised ValueError or RecursionError, not the
    JSONDecodeError the reader caught, and `tightfit train` ended in a traceback."""
    import pytest

    from conftest import tiny_cpu_job
    from tightfit.cli import main
    from tightfit.errors import TightfitError

    rows = [json.dumps({"text": f"review {i}", "label": "ab"[i % 2]}) for i in range(30)]
    for name, line, why in (("digits.jsonl", '{"text": 1' + "0" * 5000 + ', "label": "a"}',
                             r"line 4 holds an integer of more than \d+ digits"),
                            ("deep.jsonl", '{"text": "x", "label": ' + "[" * 100_000 + "]" * 100_000 + "}",
                             "line 4 nests arrays or objects too deeply")):
        (tmp_path / name).write_text("\n".join(rows[:3] + [line] + rows[3:]) + "\n")
        with pytest.raises(TightfitError, match=why):
            load_text_classification(tmp_path / name)
    (tmp_path / "indented.json").write_text('[\n  {"text": 1' + "0" * 5000 + ', "label": "a"}\n]\n')
    with pytest.raises(TightfitError, match=r"line 1 (is not valid JSON|begins a JSON array)"):
        load_text_classification(tmp_path / "indented.json")
    job = tiny_cpu_job(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", str(tmp_path / "digits.jsonl"), "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tightfit: error:")]
    assert len(errors) == 1 and "digits" in errors[0]
    assert not out.exists()


def test_a_classic_mac_csv_with_a_line_break_inside_a_cell_loads(tmp_path):
    """Excel's "CSV (Macintosh)" ends rows with a CR alone and writes a line break typed in a cell
    (Alt+Enter) as a LF inside the quoted text: with one LF in the file it was no longer taken for
    CR-ended, and was refused as 'malformed CSV at the header ... open the file in
    universal-newline mode?'. Rows end at a CR, a LF or a CRLF; quoted texts keep their breaks."""
    rows = "".join(f"review {i},{'ab'[i % 2]}\r" for i in range(30))
    (tmp_path / "mac.csv").write_bytes(('text,label\r"first line\nsecond line",b\r' + rows).encode())
    data = load_text_classification(tmp_path / "mac.csv")
    assert (len(data), data.texts[:2], data.label_names) == (31, ["first line\nsecond line", "review 0"], ["a", "b"])
    (tmp_path / "cr.csv").write_bytes(('text,label\n"kept\rwhole",b\n' + rows.replace("\r", "\r\n")).encode())
    assert load_text_classification(tmp_path / "cr.csv").texts[:2] == ["kept\rwhole", "review 0"]


def test_a_gzip_file_whose_compressed_data_is_damaged_is_one_line(tmp_path, capsys):
    """A .gz data file damaged inside its compressed data (a download cut and resumed wrongly, a bad
    disk): gzip raised zlib.error, which is no OSError, and `tightfit train` ended in a traceback
    ("Error -3 while decompressing data")."""
    import gzip

    import pytest

    from conftest import tiny_cpu_job
    from tightfit.cli import main
    from tightfit.errors import TightfitError

    rows = "".join(f"review number {i} of a film,{'ab'[i % 2]}\n" for i in range(3000))
    lines = "".join(json.dumps({"text": f"review number {i} of a film", "label": "ab"[i % 2]}) + "\n" for i in range(3000))
    for name, content in (("bad.csv.gz", "text,label\n" + rows), ("bad.jsonl.gz", lines)):
        damaged = bytearray(gzip.compress(content.encode()))
        damaged[200:400] = bytes(b ^ 0x55 for b in damaged[200:400])
        (tmp_path / name).write_bytes(bytes(damaged))
        with pytest.raises(TightfitError, match=f"{name}: cannot read \\(damaged compressed data: Error -3"):
            load_text_classification(tmp_path / name)
    job = tiny_cpu_job(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", str(tmp_path / "bad.csv.gz"), "--device", "cpu",
                 "--no-progress", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tightfit: error:")]
    assert len(errors) == 1 and "damaged compressed data" in errors[0]
    assert not out.exists()


def test_a_column_name_holding_an_invisible_character_is_shown_escaped(tmp_path):
    """A header whose 'text' carries an invisible character (a second byte order mark, from a tool
    that added one to a file that had one; a zero-width space pasted into a spreadsheet) was refused
    as "no column 'text'; columns are: label, text": the list showed the very name asked for. It is
    shown quoted and escaped, as a name with spaces around it is; an image list's columns too."""
    import pytest

    from tightfit.errors import TightfitError
    from tightfit.images import load_image_classification

    rows = "".join(f"review {i},{i % 2}\n" for i in range(10))
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + ("\ufefftext,label\n" + rows).encode())
    (tmp_path / "zw.csv").write_text("text\u200b,label\n" + rows)
    for name, shown in (("bom.csv", r"'\\ufefftext'"), ("zw.csv", r"'text\\u200b'")):
        with pytest.raises(TightfitError, match=f"no column 'text' \\(text_column\\); columns are: {shown}, label$"):
            load_text_classification(tmp_path / name)
    (tmp_path / "images.csv").write_text("path\u200b,label\nx.png,a\n")
    with pytest.raises(TightfitError, match=r"no column 'path' \(image_column\); columns are: 'path\\u200b', label$"):
        load_image_classification(str(tmp_path / "images.csv"))


def test_a_row_that_repeats_the_header_is_skipped_and_counted_not_a_sample(tmp_path, caplog):
    """``cat a.csv b.csv > all.csv`` kept b's header as a row: a sample of the text "text" in a
    one-sample class "label", seen only in the startup line's class list. A row equal to the header
    (the second file's byte order mark dropped, as the first's is) is skipped and counted in a note,
    as blank rows are; in a TSV too. A row with only some of the header's cells is data."""
    import logging

    from conftest import tiny_cpu_job

    from tightfit.cli import main

    half = [f"review {i},{['pos', 'neg'][i % 2]}" for i in range(12)]
    (tmp_path / "a.csv").write_text("\n".join(["text,label"] + half + ["text,label"] + half) + "\n")
    data = load_text_classification(tmp_path / "a.csv")
    assert (data.label_names, len(data), data.skipped_header) == (["neg", "pos"], 24, 1)
    (tmp_path / "excel.csv").write_bytes(("\ufefftext,label\n" + "\n".join(half) + "\n").encode() * 3)
    data = load_text_classification(tmp_path / "excel.csv")
    assert (data.label_names, len(data), data.skipped_header) == (["neg", "pos"], 36, 2)
    (tmp_path / "a.tsv").write_text("".join(f"{line.replace(',', chr(9))}\n" for line in ["text,label"] + half * 2
                                            + ["text,label"]))
    data = load_text_classification(tmp_path / "a.tsv")
    assert (data.label_names, len(data), data.skipped_header) == (["neg", "pos"], 24, 1)
    (tmp_path / "b.csv").write_text("\n".join(["text,label"] + half * 2 + ["text,pos"]) + "\n")
    data = load_text_classification(tmp_path / "b.csv")
    assert (len(data), data.skipped_header, data.texts[-1]) == (25, 0, "text")

    job = tiny_cpu_job(tmp_path)
    lines = (tmp_path / "data.csv").read_text().splitlines()
    (tmp_path / "data.csv").write_text("\n".join(lines[:31] + lines[:1] + lines[31:]) + "\n")
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "1",
                     "--seq-len", "16", "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "1 row identical to the header was skipped (files joined, each with its header?)" in caplog.text


def test_labels_mixing_numbers_and_words_are_noted_and_a_text_as_a_label_is_refused(tmp_path, caplog):
    """pos/neg and 0/1 in one file trained four classes without a word; a 10 MB label was taken as
    a class name and written whole into the report and the model's config."""
    import logging

    import pytest

    from tightfit.data import MAX_LABEL_CHARS, load_text_classification
    from tightfit.errors import TightfitError

    rows = [f"good film {i},{'pos' if i % 2 else '1'}" for i in range(20)] + [f"bad film {i},neg" for i in range(20)]
    (tmp_path / "mixed.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        data = load_text_classification(tmp_path / "mixed.csv")
    assert data.label_names == ["1", "neg", "pos"]
    assert "labels of column 'label' mix numbers ('1') and words ('neg', 'pos'): each is a class of its own, " \
           "3 classes in all" in caplog.text
    (tmp_path / "long.csv").write_text("text,label\n" + "\n".join(rows) + f"\nx,{'a' * (MAX_LABEL_CHARS + 1)}\n")
    with pytest.raises(TightfitError, match=r"row 41: the label \(column 'label'\) is 1,001 characters long, not a "
                                            r"class name"):
        load_text_classification(tmp_path / "long.csv")
