"""The ``on_error`` policy of one mount: what a handler's failure becomes, and its log lines.

Part of the runtime (``_mount``), used by the handler pool (``_handlers``)
inside its ``except`` clauses and for outcomes it must check: a handler
that raised (:meth:`OnError.raised`), returned something that is not an
outcome (:meth:`OnError.not_outcome`), returned writes this subscription
cannot commit (:meth:`OnError.checked`), or raised
:class:`~trio_redis_finalize.Rejected`; and a batch handler's return
(:meth:`OnError.batch_outcomes`).  None of it runs for a plain outcome.

Handler errors (``on_error``): a :class:`~trio_redis_finalize.Backoff`
(the default) on a stream or a reliable list leaves the delivery pending,
waiting in the mount's waiting set (``_backoffs``); on simple lists and
Pub/Sub (nothing pending to leave; ``FormSpec.leaves_pending``) a
``Backoff`` is a logged ``DROP``.  While ``max_attempts`` is None, a
delivery that keeps failing is logged as a warning at attempts 10, 100,
1000, ...  A failure is logged with its traceback at the first attempt and
at the last, one line in between.
"""

from __future__ import annotations

import sys

from ._core._finalize import log_extra
from ._core._plan import cells_of
from ._core._types import Target, exhausted
from ._core._writes import check_outcome
from ._deadlines import log
from ._delivery import Delivery, record_error
from ._forms import FORMS
from ._outcome import DROP, REJECT, Backoff, Outcome, Rejected, WithWrites, reject
from ._stats import MountStats

__all__ = ["OnError", "backend_hint", "shown"]

_CUT_SHOWN = 20
"""At most this many ids of deliveries in one log line (the rest counted)."""


class OnError:
    """One mount's ``on_error``: ``again`` (what a handler error becomes: the
    configured ``on_error``, or ``DROP`` for a ``Backoff`` where the form
    has nothing to leave pending) and ``text`` (its fate, for log lines)."""

    def __init__(self, name: str, target: Target, on_error: Outcome | Backoff,
                 stats: MountStats) -> None:
        self.name = name
        self.target = target
        self.stats = stats
        spec = FORMS[target.form]
        self.dead_letters = spec.dead_letters
        # what a handler error becomes: a Backoff where the form can leave the
        # delivery pending, else (simple lists, Pub/Sub) a logged DROP
        self.again: Outcome | Backoff = on_error
        if isinstance(on_error, Backoff):
            self.text = f"{on_error!r}: it stays pending and is delivered again later"
            if not spec.leaves_pending:
                self.again = DROP
                self.text = (f"dropped ({on_error!r}: a {spec.name} has nothing "
                             "to leave pending)")
        else:
            self.text = f"outcome {on_error!r}"
        cells = cells_of(target)
        # the outcome kinds whose writes check_outcome always passes here (an
        # ACK or DROP where the form has a gate and no Cluster slot to check)
        self.free = tuple(cells.removals) if cells.gated and not target.cluster else ()
        again = self.again
        self.warn_repeats = target.max_attempts is None and (
            isinstance(again, Backoff) or again.is_retry)

    def batch_outcomes(self, batch: list[Delivery], result: object) -> list[Outcome | Backoff]:
        """A batch handler's return: one outcome for all, or one per delivery."""
        if isinstance(result, Outcome):
            if result.__class__ is WithWrites:
                if len(batch) > 1:
                    return self._batch_invalid(
                        batch, result, "one outcome carrying writes for a batch of "
                        f"{len(batch)} deliveries would commit its writes {len(batch)} times: "
                        "return one outcome per delivery")
                return [result if result.kind in self.free else self.checked(batch[0], result)]
            return [result] * len(batch)
        if isinstance(result, (list, tuple)) and len(result) == len(batch):
            out: list[Outcome | Backoff] = []
            free = self.free
            for d, o in zip(batch, result, strict=True):
                if o.__class__ is Outcome:
                    out.append(o)
                elif o.__class__ is WithWrites:
                    out.append(o if o.kind in free else self.checked(d, o))
                else:
                    out.append(self.not_outcome(d, o))
            return out
        return self._batch_invalid(
            batch, result, f"a batch handler returns one Outcome, or a list or tuple of "
            f"{len(batch)} (one per delivery), not {_what(result)}")

    def batch_raised(self, batch: list[Delivery]) -> list[Outcome | Backoff]:
        """The batch handler raised (called inside the ``except``): every
        delivery of the call failed; one log line for all."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Rejected):
            return [self.rejected(d, exc) for d in batch]
        for d in batch:
            record_error(d, exc)  # for the dead-letter entries
        self._batch_failed(batch, "raised", exc)
        return [self.again] * len(batch)

    def _batch_invalid(self, batch: list[Delivery], result: object,
                       why: str) -> list[Outcome | Backoff]:
        self._batch_failed(batch, f"returned {_what(result)}", TypeError(why))
        return [self.again] * len(batch)

    def _batch_failed(self, batch: list[Delivery], what: str, exc: BaseException | None) -> None:
        self.stats.handler_errors += len(batch)
        fates: dict[str, list[str]] = {}
        for d in batch:
            fates.setdefault(self.error_text(d), []).append(
                f"{d.id or d.origin_id} (attempt {d.attempt})")
            if self.warn_repeats:
                self.keeps_failing(d)
        text = "; ".join(f"{shown(ids)}: {fate}" for fate, ids in fates.items())
        if exc is not None and not any(map(self.traceback, batch)):  # one line in between
            what = f"{what} ({type(exc).__name__}: {exc})"
            exc = None
        log.error("%s: batch handler %s on %d deliveries: %s", self.name, what, len(batch), text,
                  exc_info=exc, extra={"subscription": self.name,
                                       "entry_ids": [d.id for d in batch],
                                       "origin_ids": [d.origin_id for d in batch],
                                       "attempts": [d.attempt for d in batch]})

    def traceback(self, d: Delivery) -> bool:
        """Whether a failure of ``d`` is logged with its full traceback: at its
        first attempt and at its last (``max_attempts``, or an ``on_error``
        that does not try again); one line in between."""
        again = self.again
        if d.attempt <= 1 or not (isinstance(again, Backoff) or again.is_retry):
            return True
        return exhausted(self.target, d.attempt)

    def rejected(self, d: Delivery, exc: Rejected) -> Outcome:
        """The handler raised :class:`Rejected`: the outcome ``reject(reason)``."""
        log.warning("%s: handler rejected %s (attempt %d): %s", self.name, d.id or d.origin_id,
                    d.attempt, exc, extra=log_extra(self.name, d, REJECT))
        return reject(str(exc))

    def raised(self, d: Delivery) -> Outcome | Backoff:
        """The handler raised (called inside the ``except``): count, log, ``on_error``."""
        exc = sys.exc_info()[1]
        if isinstance(exc, Rejected):
            return self.rejected(d, exc)
        self.stats.handler_errors += 1
        record_error(d, exc)  # for the dead-letter entry
        if self.traceback(d):
            log.error(
                "%s: handler raised on %s (attempt %d); %s%s",
                self.name, d.id or d.origin_id, d.attempt, self.error_text(d), backend_hint(exc),
                exc_info=exc, extra=log_extra(self.name, d, self.again),
            )
        else:  # between the first and the last attempt: one line
            log.error(
                "%s: handler raised on %s (attempt %d): %s: %s; %s (traceback logged at the "
                "first and the last attempt)",
                self.name, d.id or d.origin_id, d.attempt, type(exc).__name__, exc,
                self.error_text(d), extra=log_extra(self.name, d, self.again),
            )
        if self.warn_repeats:
            self.keeps_failing(d)
        return self.again

    def checked(self, d: Delivery, outcome: Outcome) -> Outcome | Backoff:
        """An outcome with writes this subscription cannot commit (a key in
        another Cluster slot, a form without a gate ...) is a handler error:
        its ``ValueError`` is logged and ``on_error`` applies.  Called only
        for a kind not in :attr:`free` (the kinds whose writes always pass;
        a tuple: ``in`` by identity first): its callers (``_handlers``,
        :meth:`batch_outcomes`) test that once, where the outcome arrives."""
        try:
            check_outcome(self.target, d, outcome)
        except ValueError:
            return self.raised(d)
        return outcome

    def not_outcome(self, d: Delivery, result: object) -> Outcome | Backoff:
        """The handler returned something that is not an outcome: count, log, ``on_error``."""
        self.stats.handler_errors += 1
        log.error(
            "%s: handler returned %r, not an Outcome, for %s (attempt %d); %s",
            self.name, result, d.id or d.origin_id, d.attempt, self.error_text(d),
            exc_info=TypeError(f"handler returned {type(result).__name__}, not an Outcome"),
            extra=log_extra(self.name, d, self.again),
        )
        if self.warn_repeats:
            self.keeps_failing(d)
        return self.again

    def error_text(self, d: Delivery) -> str:
        """What becomes of ``d`` after its handler failed, for the log line: at
        the last attempt a Backoff or a retry outcome dead-letters (or drops)
        it, as the finalizer's core decides (``_core._finalize``, ``plan``)."""
        t = self.target
        again = self.again
        if not exhausted(t, d.attempt) or not (isinstance(again, Backoff) or again.is_retry):
            return self.text
        reached = f"max_attempts={t.max_attempts} reached"
        if t.dead_letter is not None and self.dead_letters:
            return f"{reached}: dead-lettered to {t.dead_letter!r}"
        return f"{reached}: dropped (no dead_letter)"

    def keeps_failing(self, d: Delivery) -> None:
        """Without ``max_attempts`` nothing ends a delivery that always fails:
        say so at attempts 10, 100, 1000, ..."""
        digits = str(d.attempt)
        if len(digits) < 2 or digits[0] != "1" or digits.count("0") != len(digits) - 1:
            return
        log.warning(
            "%s: %s (origin %s) failed again at attempt %d and will be delivered again; "
            "no max_attempts is set, so nothing ends it: set max_attempts= (and dead_letter=)",
            self.name, d.id or d.origin_id, d.origin_id, d.attempt,
            extra=log_extra(self.name, d, self.again),
        )


def backend_hint(exc: BaseException | None) -> str:
    """For an asyncio-only handler under trio ("no running event loop"): how to
    run it under asyncio; else ""."""
    if not isinstance(exc, RuntimeError) or "no running event loop" not in str(exc):
        return ""
    try:
        import sniffio  # anyio's dependency; only on this error

        if sniffio.current_async_library() != "trio":
            return ""
    except Exception:  # no library detected: say nothing
        return ""
    return ("; the handler needs asyncio but runs under trio: run the consumer under asyncio "
            "(trio-redis-finalize run ... --backend asyncio, or anyio.run(main, "
            "backend='asyncio'))")


def _what(result: object) -> str:
    """A handler's wrong return, named for its log line."""
    if isinstance(result, (list, tuple)):
        return f"a {type(result).__name__} of {len(result)}"
    return repr(result) if result is None else f"a {type(result).__name__}"


def shown(ids: list[str]) -> str:
    """At most ``_CUT_SHOWN`` of ``ids``, and how many more."""
    more = len(ids) - _CUT_SHOWN
    return ", ".join(ids[:_CUT_SHOWN]) + (f" and {more} more" if more > 0 else "")
