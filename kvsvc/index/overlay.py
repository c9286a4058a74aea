"""Block overlays: the LRU + TTL block sets of one (instance, DP rank) that routing writes itself
(§14 approximate index, §16 pending prefixes).

One mechanism, two uses:

- **Approximate index** (§14): an (instance, DP rank) of a backend listed in
  ``discovery.approximate_backends`` publishes no KV events, so it gets a :class:`BlockOverlay`
  instead of a stream. Every request routed there adds its prompt's full blocks (content keys,
  §4) as resident on Device at dispatch; an entry expires ``approximate_ttl_s`` after its last
  use and the set holds at most ``approximate_blocks`` blocks, least recently used dropped first.
  Its answers are ``completeness: "approximate"``.
- **Pending prefixes** (§16): beside an exact stream, the blocks of a prompt just routed there
  that its index does not hold yet (being prefilled) are *pending* until the stream's events
  store them, a removal or ``AllBlocksCleared`` covers them (:meth:`BlockOverlay.settle`), or
  ``pending_ttl_ms`` passes. They are answered apart (``pending_hit_tokens``), never as exact.

Representation: one ``OrderedDict`` ``content key -> monotonic seconds of its last touch``, in
touch order (oldest first), so the least recently used entry and the first to expire are both
at its head: the LRU bound and the TTL sweep pop from the head, O(1) per dropped entry, and a
touch moves an entry to the tail, O(1). No per-block object besides the key int the query
already made, and no allocation per touch.

Prefix order: a touch walks the prompt's keys from the last block to the first, so a block's
ancestors are always touched at least as recently as the block itself. Eviction and expiry
therefore drop a chain's leaves before its root, and a prefix walk (:meth:`BlockOverlay.match`)
finds the longest prefix that survives, never a hole followed by hits.

Threads: request threads touch (dispatch) and match (query) concurrently; a stream thread
settles (pending). One lock per overlay, held for one call, never while taking another lock;
nothing here does I/O. Times are passed in (``now``, ``time.monotonic()`` seconds), so the
rules are tested with an injected clock.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from kvsvc.index.changes import IndexChanges

#: (block_size, hash_seed): the geometry content keys are computed with (§4).
Geometry = tuple[int, int]


@dataclass(frozen=True, slots=True)
class OverlayStats:
    """Counters of one overlay since it was created (copied under its lock).

    :ivar blocks: entries held now (expired ones not yet swept included).
    :ivar touches: :meth:`BlockOverlay.touch` calls (dispatches recorded).
    :ivar added: blocks that were new when touched.
    :ivar refreshed: blocks that were held already when touched (their last use renewed).
    :ivar evicted: blocks dropped by the LRU bound.
    :ivar expired: blocks dropped because their TTL passed.
    :ivar settled: blocks dropped by the stream's own events (pending: stored, removed or
        cleared; :meth:`BlockOverlay.settle`), or by :meth:`BlockOverlay.clear`.
    """

    blocks: int = 0
    touches: int = 0
    added: int = 0
    refreshed: int = 0
    evicted: int = 0
    expired: int = 0
    settled: int = 0


class BlockOverlay:
    """An LRU + TTL set of content keys of one (instance, DP rank) (module docstring).

    :param ttl_s: an entry's lifetime after its last touch, seconds (> 0).
    :param max_blocks: entries held at most (>= 1); beyond it the least recently touched go.
    :raises ValueError: ``ttl_s <= 0`` or ``max_blocks < 1``.
    """

    __slots__ = ("ttl_s", "max_blocks", "_lock", "_stamps", "_touches", "_added", "_refreshed",
                 "_evicted", "_expired", "_settled")

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks!r}")
        self.ttl_s = float(ttl_s)
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._stamps: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._touches = self._added = self._refreshed = 0
        self._evicted = self._expired = self._settled = 0

    def __len__(self) -> int:
        """Entries held (expired ones not yet swept included)."""
        return len(self._stamps)

    # -- request threads ------------------------------------------------------------------------

    def touch(self, keys: Sequence[int], now: float, start: int = 0) -> int:
        """Add ``keys[start:]`` as held at ``now``, or renew their last use (dispatch, §14/§16).

        Walks from the last block to ``keys[start]`` (module docstring: ancestors stay more
        recent), then sweeps expired entries and drops the least recently used beyond
        ``max_blocks``. A prompt longer than ``max_blocks`` keeps its first ``max_blocks``
        blocks.

        :param keys: the prompt's content keys, root first (§4).
        :param now: ``time.monotonic()`` seconds; calls should not go back in time (an entry
            touched "earlier" than the head is swept late, never served past its TTL).
        :param start: the first block to add (pending: the blocks before it are exact hits).
        :returns: blocks that were new.
        """
        n = len(keys)
        if start >= n:
            return 0
        with self._lock:
            stamps = self._stamps
            move = stamps.move_to_end
            held = len(stamps)
            for i in range(n - 1, start - 1, -1):
                key = keys[i]
                if key in stamps:
                    move(key)
                stamps[key] = now
            added = len(stamps) - held
            self._touches += 1
            self._added += added
            self._refreshed += n - start - added
            self._sweep(now)
            over = len(stamps) - self.max_blocks
            if over > 0:
                pop = stamps.popitem
                for _ in range(over):
                    pop(last=False)
                self._evicted += over
            return added

    def match(self, keys: Sequence[int], now: float, start: int = 0) -> int:
        """Blocks held and not expired at ``now``, contiguous from ``keys[start]`` (§10's walk:
        it stops at the first block missing). A query does not renew a last use.

        :param keys: the prompt's content keys, root first.
        :param now: ``time.monotonic()`` seconds.
        :param start: where the walk starts (pending: after the stream's exact hits).
        :returns: a block count in ``[0, len(keys) - start]``.
        """
        stamps = self._stamps
        if not stamps:   # an atomic read: most overlays of a query hold nothing of it
            return 0
        cutoff = now - self.ttl_s
        count = 0
        with self._lock:
            get = stamps.get
            for i in range(start, len(keys)):
                stamp = get(keys[i])
                if stamp is None or stamp <= cutoff:
                    break
                count += 1
        return count

    # -- stream thread (pending) and lifecycle ----------------------------------------------------

    def discard(self, keys: Sequence[int]) -> int:
        """Drop ``keys`` (those held; the others are ignored).

        :returns: blocks dropped.
        """
        stamps = self._stamps
        if not stamps:
            return 0
        dropped = 0
        with self._lock:
            pop = stamps.pop
            for key in keys:
                if pop(key, None) is not None:
                    dropped += 1
            self._settled += dropped
        return dropped

    def clear(self) -> int:
        """Drop every entry (``AllBlocksCleared``, a new incarnation).

        :returns: blocks dropped.
        """
        with self._lock:
            dropped = len(self._stamps)
            self._stamps.clear()
            self._settled += dropped
        return dropped

    def settle(self, changes: IndexChanges) -> int:
        """Apply what one applied batch of the stream's events changed (§16): the keys it
        stored or removed are no longer pending, and an ``AllBlocksCleared`` of Device (or of
        every tier) clears the whole set. Called on the stream thread after the batch applied.

        :returns: blocks dropped.
        """
        if changes.cleared:
            return self.clear()
        return self.discard(changes.keys) if changes.keys else 0

    def sweep(self, now: float) -> int:
        """Drop the entries expired at ``now`` (touch sweeps too; this is for idle overlays).

        :returns: blocks dropped.
        """
        with self._lock:
            return self._sweep(now)

    def stats(self) -> OverlayStats:
        """The counters now (:class:`OverlayStats`)."""
        with self._lock:
            return OverlayStats(len(self._stamps), self._touches, self._added, self._refreshed,
                                self._evicted, self._expired, self._settled)

    def _sweep(self, now: float) -> int:
        """Pop expired entries from the head (caller holds the lock)."""
        stamps = self._stamps
        cutoff = now - self.ttl_s
        dropped = 0
        while stamps:
            key = next(iter(stamps))
            if stamps[key] > cutoff:
                break
            del stamps[key]
            dropped += 1
        self._expired += dropped
        return dropped


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """The content keys of one prompt's full blocks (§4), per geometry the directory serves:
    computed once by the query and handed with the routing decision to the dispatch, which
    records them in the chosen stream's overlay (no second hash of the prompt).

    :ivar by_geometry: (block_size, hash_seed) -> keys, root first.
    """

    by_geometry: Mapping[Geometry, Sequence[int]]

    def keys(self, geometry: Geometry) -> Optional[Sequence[int]]:
        """The keys for ``geometry``, ``None`` when the query did not compute them."""
        return self.by_geometry.get(geometry)
