"""The registration table ``FORMS`` (``_forms/__init__.py``): a row per form,
each consistent with the form it describes (sans-IO, no server)."""

from __future__ import annotations

from trio_redis_finalize import (
    ChannelSubscription,
    ListSubscription,
    PatternSubscription,
    ReliableListSubscription,
    StreamSubscription,
)
from trio_redis_finalize._forms import FORMS
from trio_redis_finalize._subscription import Form

SUBSCRIPTIONS = [StreamSubscription("s", "g"), ReliableListSubscription("q"), ListSubscription("l"),
                 ChannelSubscription("c"), PatternSubscription("p.*")]


def test_every_form_has_one_row_that_names_it() -> None:
    assert set(FORMS) == set(Form)
    for form, spec in FORMS.items():
        assert spec.form is form and spec.subscription.form is form
        # the words of log lines and the metrics' label, as they were written before the table
        assert spec.name == form.value
        assert spec.label == str(form.value).replace(" ", "_")


def test_a_row_describes_its_subscriptions() -> None:
    for sub in SUBSCRIPTIONS:
        spec = FORMS[sub.form]
        assert isinstance(sub, spec.subscription)
        t = sub.target("c")  # type: ignore[attr-defined]
        assert t.form is sub.form
        assert spec.reader(sub) is not None
        assert (spec.reader(sub).pending is not None) == spec.leaves_pending
        assert (spec.reader(sub).gates is not None) == spec.counted
        assert spec.has_modes == hasattr(sub, "mode")
        assert spec.by_id == bool(t.group)
        # what leaves a failed delivery pending can finalize it with writes and dead-letter it
        assert spec.leaves_pending == spec.gated == spec.dead_letters
        assert (spec.backlog is not None) == spec.keyed
        fate = spec.cut_fate.format(names="<names>", group="<group>", consumer="<consumer>",
                                    processing="<processing>")
        assert "<names>" in fate and "{" not in fate
