"""The sans-IO core: every command the consumer sends is decided here.

Nothing in this package does I/O or imports anyio, trio or the transport
(``tests/project/test_architecture.py`` checks it).  The shell (the mount, the
readers, the scheduler) reads, runs handlers and sends what the core
decided; the replies come back here to be settled into effects and counts.

What every form shares:

* ``_types``: ``Target``, ``Plan``, ``Effect``, ``settle``, ``exhausted`` and
  ``Cells``, the row of the outcome table every form fills in.
* ``_plan``: ``CELLS`` (a form's row: the core's half of the form table) and
  ``plan()``, one lookup in it.
* ``_commands``: commands and Lua scripts as plain values, each script's keys
  and arguments by name; the keys a command names.
* ``_lua``: the Lua snippets the scripts share.
* ``_replies``: error replies as values and :func:`~._replies.classify`.
* ``_batch``: a finalizer batch's first round (fast path, XACK merging, batched calls).
* ``_finalize``, ``_settlement``, ``_gates``: a finalizer batch from outcomes to settled
  effects: every round, resend, count and log record (the finalizer task only does the I/O).
* ``_writes``: an outcome's writes, in its form's gated step; ``_carrying``: what
  the gated forms' cells share (``GatedCells``); ``_hot_writes``: ACKs and DROPs
  carrying writes without a plan per delivery.
* ``_decode``: what every form's decoding of a read shares.
* ``_identity``, ``_recovery``, ``_caps``: one process per consumer name; refused
  finalizations, Backoff schedules and leases; what the server can do.

A form's own rules: ``stream/`` (cells, batched calls, decoding with the attempt rules,
liveness and the look at a group, retention, scripts) and ``reliable_list/``
(cells, counted gates, liveness, scripts).
"""
