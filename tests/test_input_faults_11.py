"""Faults a fresh user found in session 35 (resume of damaged run folders, data, plans), each kept
as a test that fails when the fault comes back."""

import json
import shutil

import pytest

from tightfit.errors import TightfitError


# ---- data


def _stars(n: int) -> list[str]:
    return ["text,stars"] + [f"review {i} of the place,{1 + i % 5}" for i in range(n)]


def test_a_quoted_multi_line_text_with_one_comma_ending_in_a_label_still_loads(tmp_path):
    """'Rating 4,5' inside a correctly quoted text read as a merged record (5 is a label)."""
    from tightfit.data import load_text_classification

    rows = _stars(30)
    rows[1] = '"Review 0: good food\nRating 4,5\nwould come back",1'
    (tmp_path / "stars.csv").write_text("\n".join(rows) + "\n")
    data = load_text_classification(tmp_path / "stars.csv", label_column="stars")
    assert len(data.texts) == 30 and data.texts[0] == "Review 0: good food\nRating 4,5\nwould come back"


def test_a_quote_left_open_over_one_whole_record_is_still_refused(tmp_path):
    """Two columns now need two lines of a field that read as records: the open record's own
    first line and the one record it swallowed whole are two."""
    from tightfit.data import load_text_classification

    rows = _stars(30)
    rows[10] = '"Wow boring from the start,2'
    rows[12] = 'the end",3'
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"record 10 .*unbalanced"):
        load_text_classification(tmp_path / "d.csv", label_column="stars")
