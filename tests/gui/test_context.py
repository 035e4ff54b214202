"""The context policy's rule on token counts alone (`fit_turns`), turns, and the planner's
exact count on a template whose per-message cost the estimate gets wrong."""

from __future__ import annotations

import pytest

from gui.chat.context import (
    DEFAULT_POLICY,
    ContextPlanner,
    ContextPolicy,
    ContextWindow,
    Entry,
    Outcome,
    fit_turns,
    group_turns,
    reply_floor,
)
from gui.store import DEFAULT_CONTEXT_POLICY

MIDDLE, ROLLING, STOP = (
    ContextPolicy.TRUNCATE_MIDDLE,
    ContextPolicy.ROLLING_WINDOW,
    ContextPolicy.STOP,
)


def test_everything_fits_with_the_whole_reply():
    fit = fit_turns([100, 100, 50], fixed=20, limit=1024, reply=512, policy=MIDDLE)
    assert fit.outcome is Outcome.FITS and fit.reply_tokens == 512
    assert fit.kept == (0, 1, 2) and fit.dropped == () and fit.prompt_tokens == 270


@pytest.mark.parametrize("policy", list(ContextPolicy))
def test_the_reply_budget_shrinks_before_any_turn_is_dropped(policy):
    # 700 tokens of chat: 512 more do not fit 1,024, the floor (256) does
    fit = fit_turns([300, 300, 80], fixed=20, limit=1024, reply=512, policy=policy)
    assert fit.outcome is Outcome.SHORTENED and fit.dropped == ()
    assert fit.reply_tokens == 1024 - 700


def test_truncate_the_middle_keeps_the_first_exchange_and_drops_the_fewest_turns():
    turns = [200, 300, 300, 300, 100]
    fit = fit_turns(turns, fixed=20, limit=1024, reply=512, policy=MIDDLE)
    # 1,220 tokens: dropping turns 1 and 2 leaves 620 + a 404-token reply
    assert fit.outcome is Outcome.DROPPED
    assert fit.kept == (0, 3, 4) and fit.dropped == (1, 2)
    assert fit.prompt_tokens == 620 and fit.reply_tokens == 404
    # once the middle is gone, the first exchange goes too rather than fail
    fit = fit_turns([600, 300, 500], fixed=20, limit=1024, reply=512, policy=MIDDLE)
    assert fit.kept == (2,) and fit.dropped == (0, 1) and fit.reply_tokens == 504


def test_rolling_window_drops_the_oldest_turns_first():
    fit = fit_turns([200, 300, 300, 300, 100], fixed=20, limit=1024, reply=512, policy=ROLLING)
    assert fit.kept == (2, 3, 4) and fit.dropped == (0, 1)
    assert fit.reply_tokens == 1024 - 720


def test_stop_sends_nothing_once_even_the_floor_does_not_fit():
    fit = fit_turns([400, 400, 100], fixed=20, limit=1024, reply=512, policy=STOP)
    assert fit.outcome is Outcome.STOPPED and not fit.outcome.sends
    assert fit.reply_tokens == 0 and fit.prompt_tokens == 920


@pytest.mark.parametrize("policy", [MIDDLE, ROLLING])
def test_a_last_message_too_long_for_the_limit_is_not_sent(policy):
    fit = fit_turns([100, 900], fixed=20, limit=1024, reply=512, policy=policy)
    assert fit.outcome is Outcome.TOO_LONG and fit.kept == (1,) and fit.reply_tokens == 0


def test_the_reply_floor():
    assert reply_floor(512, 1024) == 256
    assert reply_floor(100, 1024) == 100  # never more than asked for
    assert reply_floor(512, 512) == 128  # a quarter of a small limit


def test_turns_are_a_user_message_and_its_replies():
    roles = ["assistant", "user", "assistant", "assistant", "user"]
    entries = [Entry(i, {"role": r, "content": str(i)}) for i, r in enumerate(roles)]
    assert [[e.message_id for e in t] for t in group_turns(entries)] == [[0], [1, 2, 3], [4]]


def test_the_stored_default_is_the_policy_default():
    assert ContextPolicy.parse(DEFAULT_CONTEXT_POLICY) is DEFAULT_POLICY is MIDDLE
    assert ContextPolicy.parse("from a newer folio") is DEFAULT_POLICY


def word_template(messages: list[dict[str, str]]) -> list[str]:
    """A template whose cost per message grows with the chat (3 tokens each, 2 more
    from the third message on): per-message estimates from a two-message probe are short."""
    out = ["<bos>"]
    for i, m in enumerate(messages):
        out += ["<start>", m["role"], *m["content"].split(), "<end>"]
        out += ["<pad>", "<pad>"] if i >= 2 else []
    return [*out, "<start>", "assistant"]


def chat(turns: int, words: int) -> list[Entry]:
    entries = []
    for t in range(turns):
        question, answer = " ".join([f"q{t}"] * words), " ".join([f"a{t}"] * words)
        entries.append(Entry(2 * t, {"role": "user", "content": question}))
        entries.append(Entry(2 * t + 1, {"role": "assistant", "content": answer}))
    return entries


@pytest.mark.parametrize("policy", [MIDDLE, ROLLING])
def test_the_plan_counts_exactly_what_the_template_encodes(policy):
    planner = ContextPlanner(word_template, str.split)
    system = {"role": "system", "content": "be brief"}
    entries = [*chat(8, 40), Entry(None, {"role": "user", "content": "and now?"})]
    window = ContextWindow(cache_tokens=512, model_tokens=8192)
    plan = planner.plan(system, entries, window, policy, reply=200)
    assert plan.outcome is Outcome.DROPPED
    assert plan.prompt_tokens == len(word_template([dict(m) for m in plan.messages]))
    assert plan.prompt_tokens + plan.reply_tokens <= 512 and plan.reply_tokens >= 128
    assert plan.messages[0] == system and plan.messages[-1]["content"] == "and now?"
    roles = [m["role"] for m in plan.messages[1:]]
    assert all(a != b for a, b in zip(roles, roles[1:]))  # still alternating
    kept_ids = {e.message_id for e in entries if e.message in plan.messages}
    assert set(plan.dropped_ids).isdisjoint(kept_ids)
    assert len(plan.dropped_ids) + len(kept_ids) == len(entries)  # the draft has no id
    first_kept = 0 in kept_ids
    assert first_kept is (policy is MIDDLE)


def test_the_model_context_bounds_the_plan_as_the_cache_does():
    planner = ContextPlanner(word_template, str.split)
    entries = chat(3, 40)
    roomy = planner.plan(None, entries, ContextWindow(4096, 8192), MIDDLE, reply=64)
    tight = planner.plan(None, entries, ContextWindow(4096, 256), MIDDLE, reply=64)
    assert roomy.outcome is Outcome.FITS and tight.outcome is Outcome.DROPPED
    assert tight.window.bound_by == "the model's context length"
    assert tight.prompt_tokens + tight.reply_tokens <= 256


def test_refusals_say_what_to_do():
    planner = ContextPlanner(word_template, str.split)
    entries = chat(6, 40)
    stopped = planner.plan(None, entries, ContextWindow(512, 8192), STOP, reply=200)
    assert stopped.outcome is Outcome.STOPPED
    assert stopped.prompt_tokens == len(word_template([dict(e.message) for e in entries]))
    words = stopped.refusal()
    assert "no longer fits" in words and "Truncate the middle" in words and "new chat" in words
    long = [Entry(None, {"role": "user", "content": "w " * 600})]
    too_long = planner.plan(None, long, ContextWindow(512, 8192), MIDDLE, reply=200)
    assert too_long.outcome is Outcome.TOO_LONG and "Shorten it" in too_long.refusal()
