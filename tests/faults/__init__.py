"""Fault-injection helpers for the reliability tests (test-only, never shipped).

* :mod:`faults.chaosproxy` - a loopback TCP proxy between a client and
  redis-server: latency, stall/heal, dropped replies, RST/FIN cuts, refusal;
* :mod:`faults.shim` - a transport ``Client`` whose finalization commands fail
  at a chosen point (before sending, applied with the reply lost, cancelled),
  optionally "crashing" the process there;
* :mod:`faults.checks` - reading what Redis physically holds for each message
  and judging it: lost, stranded, duplicated.
"""
