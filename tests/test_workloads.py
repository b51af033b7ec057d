"""Shared-prefix and multi-turn workloads: seeded, and shared as the simulator tokenizes them."""

from __future__ import annotations

import collections
import itertools

import pytest

from gateway.sim.sim_engine import count_message_tokens, tokenize_messages, tokenize_text
from loadtest.loadgen import TEMPLATE_TOKENS, RequestSpec
from loadtest.workloads import (
    ConversationMix,
    PrefixMix,
    make_conversations,
    make_prefix_workload,
    unique_word,
)


def ids(spec: RequestSpec) -> list[int]:
    """The token ids the simulator sees for a spec's chat messages."""
    return tokenize_messages(spec.chat_messages())


def shared(a: list[int], b: list[int]) -> int:
    """Length of the common leading run of two id lists."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_unique_words_are_one_distinct_token_each() -> None:
    """Each unique word is 4 bytes and one token id, different for every n below 8,648."""
    words = [unique_word(n) for n in range(94 * 92)]
    assert all(len(w.encode()) == 4 for w in words)
    assert len({tokenize_text(w)[0] for w in words}) == len(words)


def test_prefix_workload_is_seeded() -> None:
    """The same seed gives the same requests; another seed other groups and suffixes."""
    mix = PrefixMix(groups=4, prefix_tokens=64, suffix_tokens=8)
    a = make_prefix_workload(30, mix, seed=5, rate=10.0)
    assert a == make_prefix_workload(30, mix, seed=5, rate=10.0)
    assert a != make_prefix_workload(30, mix, seed=6, rate=10.0)
    assert [s.at for s in a] == sorted(s.at for s in a)


def test_groups_share_exactly_their_prefix() -> None:
    """A group's requests share the template and exactly P tokens; other groups the template."""
    mix = PrefixMix(groups=3, prefix_tokens=100, suffix_tokens=20)
    specs = make_prefix_workload(40, mix, seed=2)
    for a, b in itertools.combinations(specs, 2):
        expected = TEMPLATE_TOKENS + (mix.prefix_tokens if a.group == b.group else 0)
        assert shared(ids(a), ids(b)) == expected
    for spec in specs:
        assert len(ids(spec)) == spec.prompt_tokens + TEMPLATE_TOKENS == mix.mean_prompt_tokens()
        assert spec.messages[0][0] == "user"
    assert {s.group for s in specs} == {0, 1, 2}


def test_zipf_skews_toward_the_first_groups() -> None:
    """Zipf(1.2) makes group 0 far more popular than group 7; uniform keeps groups even."""
    skewed = collections.Counter(
        s.group for s in make_prefix_workload(4000, PrefixMix(groups=8, zipf=1.2), seed=1)
    )
    even = collections.Counter(
        s.group for s in make_prefix_workload(4000, PrefixMix(groups=8), seed=1)
    )
    assert skewed[0] > 5 * skewed[7]  # 8 ** 1.2 = 12 expected
    assert skewed[0] > skewed[1] > skewed[3]
    assert all(350 < even[g] < 650 for g in range(8))  # 500 each expected


def test_conversations_resend_their_history() -> None:
    """Turn k + 1 starts with turn k's whole prompt, then an assistant answer and a user message."""
    mix = ConversationMix(conversations=3, turns=4, user_tokens=(10, 30), max_tokens=(5, 9))
    specs = make_conversations(mix, seed=4)
    assert specs == make_conversations(mix, seed=4)
    assert len(specs) == 12
    for before, after in itertools.pairwise(specs):
        if before.conversation != after.conversation:
            assert after.turn == 0
            assert shared(ids(before), ids(after)) == TEMPLATE_TOKENS  # unique first words
            continue
        assert after.turn == before.turn + 1
        assert ids(after)[: len(ids(before))] == ids(before)
        assert after.messages[: len(before.messages)] == before.messages
        answer = after.messages[len(before.messages)]
        assert answer[0] == "assistant"
        assert count_message_tokens([{"content": answer[1]}]) == before.max_tokens + 4
        assert after.messages[-1][0] == "user"
    for spec in specs:
        assert count_message_tokens(spec.chat_messages()) == spec.prompt_tokens + TEMPLATE_TOKENS


def test_users_join_mid_conversation_think_and_start_new_ones() -> None:
    """Each user sends requests_per_user requests in order: its first at a turn drawn
    uniformly (re-sending that much history), each later one a think time after the last,
    the next turn of its conversation or the first of a new one."""
    mix = ConversationMix(
        turns=4, user_tokens=(10, 30), max_tokens=(5, 9), users=40, think_s=2.0,
        requests_per_user=6,
    )  # fmt: skip
    specs = make_conversations(mix, seed=5)
    assert specs == make_conversations(mix, seed=5)
    assert len(specs) == 40 * 6
    by_user = collections.defaultdict(list)
    for spec in specs:
        by_user[spec.user].append(spec)
    assert sorted(by_user) == list(range(40))
    first_turns = collections.Counter(turns[0].turn for turns in by_user.values())
    assert set(first_turns) == {0, 1, 2, 3}  # users join at every stage
    thinks = []
    for turns in by_user.values():
        assert 0.0 <= turns[0].at <= mix.think_s
        assert turns[0].think == 0.0
        assert len({s.at for s in turns}) == 1
        for before, after in itertools.pairwise(turns):
            assert after.think > 0.0
            thinks.append(after.think)
            if after.conversation == before.conversation:
                assert after.turn == before.turn + 1
                assert ids(after)[: len(ids(before))] == ids(before)
            else:
                assert (before.turn, after.turn) == (mix.turns - 1, 0)
                assert len(after.messages) == 1
    assert 1.5 < sum(thinks) / len(thinks) < 2.5  # exponential, mean think_s
    # A conversation belongs to one user.
    owners = {(s.conversation, s.user) for s in specs}
    assert len(owners) == len({s.conversation for s in specs})


def test_mixes_refuse_bad_shapes() -> None:
    """Empty groups, negative Zipf exponents and empty ranges are refused."""
    with pytest.raises(ValueError, match="groups"):
        PrefixMix(groups=0)
    with pytest.raises(ValueError, match="zipf"):
        PrefixMix(zipf=-1.0)
    with pytest.raises(ValueError, match="user_tokens"):
        ConversationMix(user_tokens=(5, 2))
    with pytest.raises(ValueError, match="turns"):
        ConversationMix(turns=0)
    with pytest.raises(ValueError, match="think_s"):
        ConversationMix(users=4, think_s=-1.0)
