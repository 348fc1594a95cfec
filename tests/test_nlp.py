"""Sentence splitting (nlp.split_sentences), which makes the semantic units of the offline engine."""

from __future__ import annotations

import pytest

from noderag_cli.nlp import split_sentences


def test_abbreviations_initials_and_decimals_do_not_end_a_sentence():
    text = "Dr. Smith met J. R. Tolkien at 3.5 km from the U.K. border. They talked. Then it rained!"
    assert split_sentences(text) == ["Dr. Smith met J. R. Tolkien at 3.5 km from the U.K. border.", "They talked.",
                                     "Then it rained!"]


@pytest.mark.timeout(60)
def test_a_paragraph_just_under_the_line_limit_is_split_in_one_pass():
    """The word before each full stop is read from a window, not from the paragraph's start: reading
    from the start made splitting quadratic (hours for a 900,000-character paragraph)."""
    sentences = split_sentences("Dr. Vannick charted the shoals in 1903. " * 23_000)
    assert len(sentences) == 23_000 and sentences[-1] == "Dr. Vannick charted the shoals in 1903."
