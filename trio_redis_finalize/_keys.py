"""Default names of derived keys, Redis Cluster safe.

A derived key shares its source key's hash slot: ``orders`` gives
``{orders}:delayed``; a key that already has a hash tag (``{app}.orders``)
keeps it (``{app}.orders:delayed``).

A key without a hash tag that contains ``}`` (``a}b``, ``{}x``) cannot be
wrapped in a tag that covers the whole key; its derived name is the key, the
suffix (braces replaced by parentheses) and a short ``~<hex>`` counter chosen
so that the name hashes to the key's slot (``a}b:delayed~1c2f``); so is the
derived name of the empty key.

:func:`named` gives the keys the library keeps about its consumers (heartbeats,
registries) names that are one-to-one with what they describe: ``derived``
alone is not (``a`` + ``:b:c`` and ``a:b`` + ``:c``; a source ``s`` and a
source ``{s}``).
"""

from __future__ import annotations

from redis.crc import key_slot

__all__ = ["derived", "derived_prefix", "escape", "has_hash_tag", "named", "same_slot", "slot"]


def has_hash_tag(key: str) -> bool:
    """True when ``key`` has a non-empty ``{...}`` hash tag."""
    start = key.find("{")
    if start < 0:
        return False
    end = key.find("}", start + 1)
    return end > start + 1


def derived(key: str, suffix: str) -> str:
    """``key`` + ``suffix`` in the same hash slot as ``key``."""
    if has_hash_tag(key):
        return f"{key}{suffix}"
    if key and "}" not in key:
        # ``{key}`` is a tag whose content is the whole key (a ``{`` inside
        # the key is part of the tag's content, the first ``}`` closes it).
        return f"{{{key}}}{suffix}"
    # No tag, and a ``}`` that would close a wrapping tag too early (or an
    # empty key, whose ``{}`` would be no tag at all): the slot
    # is the CRC of the whole name, so search a counter that matches it.  The
    # base name has no valid tag (no new braces), and neither has any
    # candidate, so the search ends (in ~16384 tries on average).
    base = key + suffix.replace("{", "(").replace("}", ")")
    want = slot(key)
    n = 0
    while True:
        candidate = f"{base}~{n:x}"
        if slot(candidate) == want:
            return candidate
        n += 1


def derived_prefix(key: str, suffix: str) -> str:
    """What every ``derived(key, suffix + more)`` starts with (a ``SCAN
    MATCH`` prefix): ``derived(key, suffix)``, but, for a key whose derived
    names end in a counter, that name without it."""
    if has_hash_tag(key) or (key and "}" not in key):
        return derived(key, suffix)
    return key + suffix.replace("{", "(").replace("}", ")")


_ESCAPED = {c: f"%{ord(c):02X}" for c in "%:,{}~"}


def escape(part: str) -> str:
    """``part`` with ``%``, ``:``, ``,``, braces and ``~`` percent-escaped
    (``%25``, ``%3A``, ``%2C``, ``%7B``, ``%7D``, ``%7E``): one-to-one, and
    none of those characters left."""
    return "".join(_ESCAPED.get(c, c) for c in part)


def named(source: str, kind: str, *parts: str) -> str:
    """The key of ``kind`` about ``source`` and ``parts``, in ``source``'s slot:
    ``derived(source, ":<kind>:<source>,<part>,...")``, each name escaped
    (:func:`escape`): ``named("orders", "stream-heartbeat", "billing", "w1")``
    is ``{orders}:stream-heartbeat:orders,billing,w1``.

    One-to-one in (``kind``, ``source``, ``parts``) for kinds made of
    letters and ``-``: the name ends with ``:<kind>:<escaped names>``
    (``derived``'s ``~<hex>`` after it, for a source it cannot tag), the
    escaped names have no ``:``, ``,`` or ``~``, so the last two fields read
    back as the kind and the names, the source among them; and what is before
    them is ``derived``'s prefix of that source.
    """
    return derived(source, f":{kind}:" + ",".join(escape(p) for p in (source, *parts)))


def slot(key: str | bytes) -> int:
    """The Redis Cluster hash slot of ``key``."""
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def same_slot(*keys: str | bytes) -> bool:
    """True when every key hashes to the same Redis Cluster slot."""
    return len({slot(k) for k in keys}) <= 1
