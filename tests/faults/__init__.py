"""Fault-injection helpers for the reliability tests (test-only, never shipped).

* :mod:`faults.chaosproxy` - a loopback TCP proxy between a client and
  redis-server: latency, stall/heal, dropped replies, RST/FIN cuts, refusal;
* :mod:`faults.cmdproxy` - a command-aware proxy: for the k-th request of one
  command kind (``XACK``, ``XREADGROUP>``, ``EVALSHA:<script>``, ...) the reply
  is lost, the connection blackholed, or a transient error reply (OOM, BUSY,
  READONLY, ...) is sent instead of running it; pipelines mapped in order;
* :mod:`faults.shim` - a transport ``Client`` whose finalization commands fail
  at a chosen point (before sending, applied with the reply lost, cancelled),
  optionally "crashing" the process there;
* :mod:`faults.checks` - reading what Redis physically holds for each message
  and judging it: lost, stranded, duplicated.
"""
