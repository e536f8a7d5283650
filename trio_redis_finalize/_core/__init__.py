"""The sans-IO core: every command the consumer sends is decided here.

Nothing in this package does I/O or imports anyio, trio or the transport
(``tests/project/test_architecture.py`` checks it).  The shell (the mount, the
readers, the scheduler) reads, runs handlers and sends what the core
decided; the replies come back here to be settled into effects and counts.

* ``_commands``: commands and Lua scripts as plain values; the keys a command names.
* ``_replies``: error replies as values and :func:`~._replies.classify`.
* ``_plan``: what an outcome becomes, per form (the table the README shows).
* ``stream.scripts``, ``reliable_list.scripts`` (built from ``_lua``): the Lua scripts the plans run.
* ``_batch``: a finalizer batch's first round (fast path, XACK merging, two-step plans).
* ``_finalize``: a finalizer batch from outcomes to settled effects: every round,
  resend, count and log record (the finalizer task only does the I/O).
* ``_decode``: replies of reads turned into deliveries.
* ``_reliable``: the reliable list's keys, reader scripts, counter bumps and multiset counting.
* ``_presence``: stream consumers' heartbeat keys and registry, the reaper's script, and
  what a look at the group decides (who is dead, what to take, what to warn about).
"""
