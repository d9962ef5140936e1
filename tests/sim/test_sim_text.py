"""Text and stop strings: a stop string is cut wherever it falls, and never leaks in pieces."""

from sim.text import VOCABULARY, TextStream


def generate(seed, stop, n, per_step):
    stream = TextStream(seed, stop)
    pieces, used_total = [], 0
    while used_total < n and not stream.stopped:
        used_total += stream.extend(min(per_step, n - used_total))
        pieces.append(stream.take(final=stream.stopped or used_total >= n))
    return pieces, used_total, stream


def test_text_is_words_and_repeatable():
    pieces, used, _ = generate(5, (), 50, 3)
    text = "".join(pieces)
    assert used == 50 and len(text.split()) == 50 and set(text.split()) <= set(VOCABULARY)
    assert "".join(generate(5, (), 50, 1)[0]) == text  # chunking does not change the text


def test_stop_string_spanning_tokens_is_cut_and_never_streamed_in_part():
    full = "".join(generate(1, (), 400, 1)[0])
    stop = full.split()[30] + " " + full.split()[31]  # two words: spans a token boundary
    for per_step in (1, 2, 4):
        pieces, used, stream = generate(1, (stop,), 400, per_step)
        text = "".join(pieces)
        assert stream.stopped and stream.matched_stop == stop
        assert text == full[: full.index(stop)]
        assert used == len(full[: full.index(stop) + len(stop)].split())
        # No piece ends with a prefix of the stop string that a later piece completes.
        assert all(stop not in p for p in pieces)


def test_without_a_match_everything_is_released_at_the_end():
    pieces, used, stream = generate(2, ("zzz-never",), 40, 4)
    assert not stream.stopped and len("".join(pieces).split()) == 40 == used
