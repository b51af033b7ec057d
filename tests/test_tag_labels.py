"""`X-Request-Tag` labels: a bounded set of slots, taken only by requests that reached an
instance and given up by tags that went idle (observe/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.observe.metrics import OTHER_TAG, TAG_IDLE_S, Metrics


def _count(metrics: Metrics, tag: str, *, reached: bool = True, now: float = 0.0) -> None:
    metrics.request_series(
        "chat.completions", "200", "short", "m", tag, reached=reached, now=now
    ).inc()


def test_requests_that_reached_no_instance_take_no_slot() -> None:
    """Forty 404s with invented tags leave every slot for the tags of real traffic."""
    metrics = Metrics(CollectorRegistry(), max_tags=2)
    for i in range(40):
        assert metrics.tag_label(f"bogus-{i}", reached=False) == OTHER_TAG
    _count(metrics, "team-a")
    assert metrics.tag_label("team-a", reached=False) == "team-a"  # held slots still label


def test_a_full_set_labels_new_tags_other_until_one_goes_idle() -> None:
    """With every slot held and in use, a new tag is 'other'; an idle one's slot frees."""
    metrics = Metrics(CollectorRegistry(), max_tags=2)
    _count(metrics, "a", now=0)
    _count(metrics, "b", now=100)
    assert metrics.tag_label("c", now=200) == OTHER_TAG
    assert metrics.tag_label("c", now=TAG_IDLE_S + 1) == "c"  # "a" idle since 0: freed
    text = generate_latest(metrics.registry).decode()
    assert 'tag="a"' not in text  # its series went with its slot: cardinality stays bounded
    assert 'tag="b"' in text


def test_the_configured_tag_is_never_given_up() -> None:
    """The tag series made at start (the channel's X-Request-Tag) keeps its slot."""
    metrics = Metrics(CollectorRegistry(), max_tags=1)
    metrics.start_series(["s1"], placed_routes=["chat.completions"], tag="bench")
    assert metrics.tag_label("other-team", now=10 * TAG_IDLE_S) == OTHER_TAG
    assert metrics.tag_label("bench", reached=False) == "bench"
