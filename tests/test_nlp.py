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


def test_the_word_memory_gives_the_tokenizers_own_ids():
    """token_ids tokenizes word by word through a memory only when the tokenizer's configuration
    allows it (checked at load); its ids must be the tokenizer's on text with runs of spaces, a
    literal "▁", digits, punctuation and words met twice."""
    from noderag_cli import nlp

    assert nlp.token_ids._check()  # the bundled tokenizer takes the fast path
    texts = ["Harlow Ferry was founded in 1903, by the Sound Maritime Society.",
             "  two  spaces,\ttab and a \u2581 mark; Harlow Ferry again!", "", "naïve café – 3.14 ×2"]
    expected = [e.ids for e in nlp._tokenizer().encode_batch(texts, add_special_tokens=False)]
    assert nlp.token_ids(texts) == expected
    assert nlp.token_ids(texts[:1]) == expected[:1]  # the second time from the memory


def test_counting_known_takes_given_counts_and_counts_the_rest_once():
    """A stage's update counts only the texts its last table did not hold (the given count is
    believed: the table it comes from is checked against its checksum before)."""
    from noderag_cli import nlp

    count = nlp.counting_known(["kept summary text"], [999])
    fresh = "A new summary, counted now."
    assert count(["kept summary text", fresh, fresh]) == [999, *nlp.count_tokens([fresh] * 2)]


def test_the_tokenizer_and_embedding_model_loaded_ahead_are_loaded_once_and_used():
    """`load_ahead` and an Embedder load on threads while the caller goes on; a caller that asks at
    once waits for that load (one tokenizer, one table) and gets the same ids and vectors as a
    process that loads them itself. In a child process: this one has them loaded already."""
    import subprocess
    import sys

    script = """
import threading
from noderag_cli import embeddings, nlp
from noderag_cli.config import EmbeddingConfig
nlp.load_ahead()
embedder = embeddings.Embedder(EmbeddingConfig(), None)
seen = []
threads = [threading.Thread(target=lambda: seen.append((nlp._tokenizer(), embeddings.load_model(embedder.config))))
           for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
assert len({id(t) for t, _ in seen}) == 1 and len({id(m) for _, m in seen}) == 1
assert len(nlp._LOADED) == 1 and len(embeddings._MODELS) == 1
print(nlp.count_tokens(["Harlow Ferry lies on the river."])[0], embeddings.mean_pool(seen[0][1], ["Harlow Ferry"]).tobytes().hex())
"""
    ahead = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    plain = subprocess.run([sys.executable, "-c", """
from noderag_cli import embeddings, nlp
from noderag_cli.config import EmbeddingConfig
model = embeddings.load_model(EmbeddingConfig())
print(nlp.count_tokens(["Harlow Ferry lies on the river."])[0], embeddings.mean_pool(model, ["Harlow Ferry"]).tobytes().hex())
"""], capture_output=True, text=True, check=True).stdout
    assert ahead == plain and int(ahead.split()[0]) > 5
