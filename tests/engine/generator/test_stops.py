"""Stop handling (engine/generator/stops.py) with a byte-level fake tokenizer and SmolLM2's own."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.generator.stops import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StopAutomaton,
    StopHandler,
    StopReason,
    StopStep,
)
from engine.model.tokenizer import IncrementalDecoder, Tokenizer

EOS = 0


class ByteTokenizer:
    """Token id -> byte string; decodes like a byte-level BPE (invalid UTF-8 becomes U+FFFD)."""

    def __init__(self, pieces: Sequence[bytes]):
        self.pieces = [b"<eos>", *pieces]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


def tokens(*pieces: str | bytes) -> tuple[ByteTokenizer, list[int]]:
    """A fake tokenizer whose tokens are ``pieces``, and the ids spelling them in order."""
    raw = [p.encode() if isinstance(p, str) else p for p in pieces]
    return ByteTokenizer(raw), list(range(1, len(raw) + 1))


def run(
    handler: StopHandler, ids: Sequence[int], finish: StopReason | None = None
) -> list[StopStep]:
    """Feed ids until the handler finishes (then finish() it if ``finish`` is given)."""
    steps = []
    for token_id in ids:
        steps.append(handler.feed(token_id))
        if steps[-1].finished:
            return steps
    if finish is not None:
        steps.append(handler.finish(finish))
    return steps


def handler_for(
    tok, stop_strings: Sequence[str] = (), max_new_tokens: int = 1000, stop_ids=(EOS,)
) -> StopHandler:
    return StopHandler(tok, stop_ids, stop_strings, max_new_tokens=max_new_tokens)


# --------------------------------------------------------------------------------------------------
# stop tokens and max_new_tokens
# --------------------------------------------------------------------------------------------------


def test_stop_token_ends_the_sequence_without_text():
    tok, ids = tokens("Hello", " world")
    h = handler_for(tok)
    steps = run(h, [*ids, EOS, 1])
    assert [s.text for s in steps] == ["Hello", " world", ""]
    assert steps[-1] == StopStep("", [EOS], StopReason.STOP_TOKEN)
    assert h.text == "Hello world"
    assert h.token_ids == [1, 2, EOS]
    assert h.finished is StopReason.STOP_TOKEN
    with pytest.raises(RuntimeError, match="already finished"):
        h.feed(1)
    with pytest.raises(RuntimeError):
        h.finish(StopReason.CANCELLED)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_max_new_tokens_is_exact(n):
    tok, ids = tokens(*"abcdefgh")
    h = handler_for(tok, max_new_tokens=n)
    steps = run(h, ids)
    assert len(steps) == n
    assert [s.finished for s in steps] == [None] * (n - 1) + [StopReason.MAX_NEW_TOKENS]
    assert steps[-1].text == "abcdefgh"[n - 1]  # the Nth token's text is emitted
    assert h.text == "abcdefgh"[:n]
    assert h.token_ids == ids[:n]


def test_stop_token_wins_over_max_new_tokens_on_the_same_step():
    tok, ids = tokens("a", "b")
    h = handler_for(tok, max_new_tokens=3)
    steps = run(h, [*ids, EOS])
    assert steps[-1] == StopStep("", [EOS], StopReason.STOP_TOKEN)
    assert h.token_ids == [1, 2, EOS]
    assert h.text == "ab"


def test_max_new_tokens_releases_a_partial_stop_string():
    tok, ids = tokens("x", "ST", "O")
    h = handler_for(tok, ["STOP"], max_new_tokens=3)
    steps = run(h, ids)
    assert [s.text for s in steps] == ["x", "", "STO"]
    assert steps[-1].finished is StopReason.MAX_NEW_TOKENS
    assert h.text == "xSTO" and h.held == ""


def test_stop_string_completed_by_the_last_allowed_token_is_cut():
    tok, ids = tokens("x", "ST", "OPy")
    h = handler_for(tok, ["STOP"], max_new_tokens=3)
    steps = run(h, ids)
    assert steps[-1] == StopStep("", [3], StopReason.STOP_STRING)
    assert h.text == "x"


def test_stop_token_releases_held_text():
    tok, ids = tokens("x", "ST")
    h = handler_for(tok, ["STOP"])
    steps = run(h, [*ids, EOS])
    assert [s.text for s in steps] == ["x", "", "ST"]
    assert steps[-1].finished is StopReason.STOP_TOKEN


# --------------------------------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------------------------------


def test_stop_string_split_across_three_tokens():
    tok, ids = tokens("Hi ", "S", "TO", "P tail", "never")
    h = handler_for(tok, ["STOP"])
    steps = run(h, ids)
    assert [s.text for s in steps] == ["Hi ", "", "", ""]
    assert steps[-1].finished is StopReason.STOP_STRING
    assert steps[-1].token_ids == [4]
    assert h.text == "Hi " and h.held == ""
    assert h.token_ids == [1, 2, 3, 4]


def test_stop_string_in_the_middle_of_a_token():
    tok, ids = tokens("one ", "two...STOP...three")
    h = handler_for(tok, ["STOP"])
    steps = run(h, ids)
    assert steps[-1] == StopStep("two...", [2], StopReason.STOP_STRING)
    assert h.text == "one two..."


def test_false_start_is_released_when_the_text_diverges():
    tok, ids = tokens("a", "STO", "x", "b")
    h = handler_for(tok, ["STOP"])
    steps = run(h, ids, finish=StopReason.CANCELLED)
    assert [s.text for s in steps] == ["a", "", "STOx", "b", ""]
    assert h.held == "" and h.text == "aSTOxb"
    assert steps[-1].finished is StopReason.CANCELLED


def test_divergence_keeps_a_new_prefix_held():
    # "SST": after "SS" diverges from "STOP", the second "S" may still start it
    tok, ids = tokens("S", "S", "T", "OP")
    h = handler_for(tok, ["STOP"])
    steps = run(h, ids)
    assert [s.text for s in steps] == ["", "S", "", ""]
    assert steps[-1].finished is StopReason.STOP_STRING
    assert h.text == "S"


def test_earliest_match_wins_with_overlapping_stop_strings():
    tok, ids = tokens("xa", "b")
    for stops in (["ab", "b"], ["b", "ab"]):
        h = handler_for(tok, stops)
        run(h, ids)
        assert h.finished is StopReason.STOP_STRING
        assert h.text == "x"
    tok, ids = tokens("xab")
    h = handler_for(tok, ["b", "ab"])
    run(h, ids)
    assert h.text == "x"


def test_a_stop_string_completed_first_ends_the_sequence():
    # "bcd" started earlier but is not complete when "c" is: generation stops on "c"
    tok, ids = tokens("x", "b", "c", "d")
    h = handler_for(tok, ["bcd", "c"])
    steps = run(h, ids)
    assert len(steps) == 3 and steps[-1].finished is StopReason.STOP_STRING
    assert h.text == "xb"
    # in one token both are complete: the earlier start wins
    tok, ids = tokens("x", "b", "cd")
    h = handler_for(tok, ["bcd", "c"])
    run(h, ids)
    assert h.text == "x"


def test_one_token_completing_two_stop_strings_cuts_at_the_earlier():
    tok, ids = tokens("zz E", "ND and STOP")
    h = handler_for(tok, ["STOP", "END"])
    steps = run(h, ids)
    assert [s.text for s in steps] == ["zz ", ""]
    assert h.text == "zz "


def test_multibyte_character_split_across_tokens():
    euro = "€".encode()
    tok, ids = tokens(b"1", euro[:1], euro[1:2], euro[2:] + b"2")
    h = handler_for(tok)
    steps = run(h, ids, finish=StopReason.CANCELLED)
    assert [s.text for s in steps] == ["1", "", "", "€2", ""]
    assert h.text == "1€2"


def test_text_before_a_split_character_waits_for_it():
    # the incremental decoder releases a token's text once its last character is whole, so
    # "S" is seen only with the next token, which also completes the earlier-starting "€S€"
    euro = "€".encode()
    tok, ids = tokens(euro, b"S" + euro[:1], euro[1:])
    h = handler_for(tok, ["S", "€S€"])
    steps = run(h, ids)
    assert [s.text for s in steps] == ["", "", ""]
    assert steps[-1].finished is StopReason.STOP_STRING


def test_stop_string_starting_with_a_split_character():
    euro = "€".encode()
    tok, ids = tokens(b"ok", euro[:2], euro[2:] + b"EN", b"D!")
    h = handler_for(tok, ["€END"])
    steps = run(h, ids)
    assert [s.text for s in steps] == ["ok", "", "", ""]
    assert steps[-1].finished is StopReason.STOP_STRING
    assert h.text == "ok"


def test_cancel_releases_held_text_and_dangling_bytes():
    tok, ids = tokens("a", "ST", b"\xe2\x82")
    h = handler_for(tok, ["STOP"])
    steps = run(h, ids, finish="cancelled")
    assert [s.text for s in steps] == ["a", "", "", "ST\ufffd"]
    assert steps[-1] == StopStep("ST\ufffd", [], StopReason.CANCELLED)
    assert h.text == tok.decode(ids)


def test_error_finish():
    tok, ids = tokens("a", "b")
    h = handler_for(tok)
    run(h, ids)
    assert h.finish(StopReason.ERROR) == StopStep("", [], StopReason.ERROR)


def test_invalid_arguments():
    tok, _ = tokens("a")
    with pytest.raises(ValueError, match="must not be empty"):
        handler_for(tok, ["STOP", ""])
    with pytest.raises(TypeError, match="sequence of strings"):
        handler_for(tok, "STOP")
    with pytest.raises(ValueError, match="max_new_tokens"):
        handler_for(tok, max_new_tokens=0)
    with pytest.raises(ValueError):
        handler_for(tok).finish("bogus")


# --------------------------------------------------------------------------------------------------
# property: token by token equals cutting the whole text
# --------------------------------------------------------------------------------------------------

ALPHABET = "abST OP€😀\n"


def expected(text: str, stops: Sequence[str]) -> str:
    starts = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(starts)] if starts else text


@st.composite
def chunked_text(draw) -> tuple[str, list[bytes]]:
    """A text and its UTF-8 bytes cut at random points (characters split included)."""
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    raw = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=len(raw))))
    bounds = [0, *[c for c in cuts if c < len(raw)], len(raw)]
    return text, [raw[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def streamed_expected(pieces: Sequence[bytes], stops: Sequence[str]) -> str:
    """The output when generation stops at the first token after which the text contains a stop
    string, cut at the earliest match then present. Text becomes visible at token boundaries
    that end a character (the incremental decoder holds a token's whole text until then)."""
    raw = b""
    for piece in pieces:
        raw += piece
        try:
            text = raw.decode()
        except UnicodeDecodeError:  # ends inside a character
            continue
        if any(s in text for s in stops):
            return expected(text, stops)
    return raw.decode()


@settings(max_examples=250, deadline=None)
@given(chunked_text(), st.text(alphabet=ALPHABET, min_size=1, max_size=4))
def test_property_one_stop_string(chunked, stop):
    text, pieces = chunked
    tok, ids = tokens(*pieces)
    h = handler_for(tok, [stop])
    steps = run(h, ids, finish=StopReason.CANCELLED)
    emitted = "".join(s.text for s in steps)
    assert emitted == h.text == (text[: text.find(stop)] if stop in text else text)
    assert stop not in emitted
    assert h.finished is (StopReason.STOP_STRING if stop in text else StopReason.CANCELLED)


@settings(max_examples=250, deadline=None)
@given(
    chunked_text(),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_property_several_stop_strings(chunked, stops):
    text, pieces = chunked
    tok, ids = tokens(*pieces)
    h = handler_for(tok, stops)
    steps = run(h, ids, finish=StopReason.CANCELLED)
    emitted = "".join(s.text for s in steps)
    want = streamed_expected(pieces, stops)
    assert emitted == h.text == want
    for stop in stops:
        assert stop not in emitted
    found = any(s in text for s in stops)
    assert h.finished is (StopReason.STOP_STRING if found else StopReason.CANCELLED)


@settings(max_examples=60, deadline=None)
@given(
    chunked_text(),
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=20, max_size=200),
)
def test_property_many_stop_strings(chunked, stops):
    text, pieces = chunked
    tok, ids = tokens(*pieces)
    h = handler_for(tok, stops)
    steps = run(h, ids, finish=StopReason.CANCELLED)
    assert "".join(s.text for s in steps) == h.text == streamed_expected(pieces, stops)


# --------------------------------------------------------------------------------------------------
# the cost of a long stop list (issue 13, defect 9)
# --------------------------------------------------------------------------------------------------


class CountedReads(list):
    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_matching_work_per_character_does_not_grow_with_the_stop_list(monkeypatch):
    """The largest list allowed, built so that the text keeps a long prefix of one stop string
    held while every other string almost matches: the quadratic search this replaced made
    ~30,000 suffix comparisons per token here. The automaton reads one match length per
    character, and follows fewer fail links than characters fed over the whole run."""
    longest = MAX_STOP_STRING_CHARS
    stops = [b * i + "c" * (longest - i) for b in "bd" for i in range(1, MAX_STOP_STRINGS // 2)]
    stops.append("a" * longest)
    assert len(stops) <= MAX_STOP_STRINGS
    automaton = StopAutomaton.for_stops(tuple(stops))  # the one every handler of this list shares
    fail, matches = CountedReads(automaton.fail), CountedReads(automaton.longest)
    monkeypatch.setattr(automaton, "fail", fail)
    monkeypatch.setattr(automaton, "longest", matches)
    pieces = ["a" * 3, "b", "a" * 50, "dd", "ab", "a" * 200]
    tok, ids = tokens(*pieces)
    h = handler_for(tok, stops)
    steps = run(h, ids)
    fed = sum(map(len, pieces))
    assert steps[-1].finished is StopReason.STOP_STRING
    assert h.text == expected("".join(pieces), stops)
    assert 0 < matches.reads <= fed
    assert fail.reads <= fed


# --------------------------------------------------------------------------------------------------
# SmolLM2's tokenizer
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def test_smollm2_stop_string(smollm2_tokenizer):
    tk = smollm2_tokenizer
    text = "The answer is 42.\nUser: what else?\nAssistant: nothing"
    ids = tk.encode(text, add_special_tokens=False)
    h = StopHandler(tk, tk.eos_token_ids, ["\nUser:"], max_new_tokens=len(ids))
    steps = run(h, ids)
    assert steps[-1].finished is StopReason.STOP_STRING
    assert "".join(s.text for s in steps) == h.text == "The answer is 42."
    assert len(h.token_ids) < len(ids)


def test_smollm2_stop_string_inside_a_word(smollm2_tokenizer):
    tk = smollm2_tokenizer
    text = "Hello 😀 world STOP here"
    ids = tk.encode(text, add_special_tokens=False)
    h = StopHandler(tk, tk.eos_token_ids, ["TOP"], max_new_tokens=100)
    run(h, ids)
    assert h.text == "Hello 😀 world S"


def test_smollm2_emoji_comes_out_whole(smollm2_tokenizer):
    tk = smollm2_tokenizer
    text = "a 😀🦙 b"
    ids = tk.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tk.decode([i]) for i in ids)  # the emoji is split into byte tokens
    h = StopHandler(tk, tk.eos_token_ids, max_new_tokens=100)
    steps = run(h, [*ids, tk.eos_token_id])
    assert all("\ufffd" not in s.text for s in steps)
    assert "😀" in [s.text.strip() for s in steps]
    assert h.text == text
    assert steps[-1].finished is StopReason.STOP_TOKEN


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet="abc STOP.\n€😀", max_size=40),
    st.text(alphabet="abc STOP.\n€😀", min_size=1, max_size=5),
)
def test_property_smollm2(smollm2_tokenizer, text, stop):
    tk = smollm2_tokenizer
    ids = tk.encode(text, add_special_tokens=False)
    assert tk.decode(ids) == text
    h = StopHandler(tk, tk.eos_token_ids, [stop], max_new_tokens=max(1, len(ids)))
    steps = run(h, ids)
    emitted = "".join(s.text for s in steps)
    assert emitted == (text[: text.find(stop)] if stop in text else text)
    assert stop not in emitted
