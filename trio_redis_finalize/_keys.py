"""Default names of derived keys, Redis Cluster safe.

A derived key shares its source key's hash slot: ``orders`` gives
``{orders}:delayed``; a key that already has a hash tag (``{app}.orders``)
keeps it (``{app}.orders:delayed``).
"""

from __future__ import annotations

from redis.crc import key_slot

__all__ = ["derived", "has_hash_tag", "same_slot", "slot"]


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
    return f"{{{key}}}{suffix}"


def slot(key: str | bytes) -> int:
    """The Redis Cluster hash slot of ``key``."""
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def same_slot(*keys: str | bytes) -> bool:
    """True when every key hashes to the same Redis Cluster slot."""
    return len({slot(k) for k in keys}) <= 1
