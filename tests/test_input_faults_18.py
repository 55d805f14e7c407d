"""Text data faults a review found: copies that differ only in spacing went unnoted, and the CSV
merge check missed an open quote before an id column and refused a correctly quoted two-line text."""
import csv

import pytest

from tightfit.data import TextClassificationData, check_split, held_out_split, load_text_classification
from tightfit.errors import TightfitError


def test_held_out_copies_that_differ_only_in_spacing_are_noted_as_copies():
    """A held-out text that is a training text with a trailing space, a CRLF for a LF or doubled
    spaces is the same text word for word (the tokenizer gives the same tokens): the note counted
    only byte-identical copies, so 5 of these 8 leaked held-out samples went unsaid."""
    texts = [f"review number {i} was fine" for i in range(100)]
    labels = [i % 2 for i in range(100)]
    train, held_out = held_out_split(100)
    variants = ["{} ", " {}", "{}\r\n", "{}\n", "{}"]
    for k, e in enumerate(held_out[:5]):
        texts[e] = variants[k].format(texts[train[k]]).replace("number", "number " if k == 4 else "number")
    for k, e in enumerate(held_out[5:8]):
        texts[e] = texts[train[10 + k]]  # byte for byte
    data = TextClassificationData(texts, labels, ["a", "b"], "x")
    notes = check_split(data, data.subset(train), data.subset(held_out))
    copies = [n for n in notes if "word for word" in n]
    assert copies and copies[0].startswith("8 held-out samples"), notes


def test_a_text_under_two_labels_that_differ_only_in_spacing_is_noted():
    texts = [f"review number {i} was fine" for i in range(40)]
    labels = [0] * 20 + [1] * 20
    texts[30] = texts[3] + " "  # the same review, class 1 here and class 0 there
    data = TextClassificationData(texts, labels, ["a", "b"], "x")
    train, held_out = held_out_split(40)
    notes = check_split(data, data.subset(train), data.subset(held_out))
    assert any("under two or more labels" in n for n in notes), notes


def _stars_file(path, text):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)  # quoted as csv writes it: every quote closed
        w.writerow(["text", "stars"])
        for i in range(40):
            w.writerow([f"review {i} of the phone", str(1 + i % 5)])
        w.writerow([text, "5"])


def test_a_correctly_quoted_text_with_two_lines_that_end_in_labels_still_loads(tmp_path):
    """A review written by csv.writer, every quote closed, whose text lists per-aspect scores over
    two lines ("Battery,5", "Screen,4") was refused as "an unbalanced quote merged the records"."""
    text = "Scores by aspect:\nBattery,5\nScreen,4\nOverall a fine phone"
    _stars_file(tmp_path / "d.csv", text)
    data = load_text_classification(tmp_path / "d.csv", label_column="stars")
    assert len(data) == 41 and data.texts[-1] == text


@pytest.mark.parametrize("opened", ['"Wow boring from the start,2', '"Wow, boring, from the start,2'])
def test_a_quote_left_open_is_still_refused_also_where_the_text_holds_commas(tmp_path, opened):
    rows = ["text,stars"] + [f"review {i} of the place,{1 + i % 5}" for i in range(30)]
    rows[10] = opened
    rows[14] = 'the end",3'
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"record 10 .*unbalanced"):
        load_text_classification(tmp_path / "d.csv", label_column="stars")


def test_a_quote_left_open_in_a_middle_column_is_still_refused(tmp_path):
    rows = ["id,text,label"] + [f"{i},review {i} was fine,{'pos' if i % 2 else 'neg'}" for i in range(40)]
    rows[10] = '9,"Wow boring from the start,pos'
    rows[14] = '13,the end",neg'
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"record 10 .*unbalanced"):
        load_text_classification(tmp_path / "d.csv")


def test_a_correctly_quoted_last_column_text_with_a_line_of_a_label_and_words_still_loads(tmp_path):
    """With the text the last column and ids beside it, a line of the text that starts with a label
    value ("5,screen,bright") was taken for a swallowed record on the label alone (ids and texts
    repeat nowhere): a file csv.writer wrote, every quote closed, was refused. It loaded before."""
    text = "My scores (stars,part,why):\n5,screen,bright and sharp\n4,battery,lasts a day"
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stars", "id", "text"])
        w.writerows([str(1 + i % 5), str(i), f"review {i} of the phone"] for i in range(40))
        w.writerow(["5", "40", text])
    data = load_text_classification(tmp_path / "d.csv", label_column="stars")
    assert len(data) == 41 and data.texts[-1] == text
