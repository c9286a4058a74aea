"""Tokenization that does not start from zero each turn (issue 22 item 3): the token ids of text
segments already seen, cached and reused, exact (the same ids as tokenizing the whole text).

A conversation's prompt grows by a turn each request; its earlier turns render to the same
text. :class:`SegmentTokenCache` cuts the text only where the tokenizer's result is provably
compositional, tokenizes each segment on its own (or takes its ids from the cache) and joins
the ids:

- **after each added token** (``<|im_end|>``, ``<|im_start|>`` ...): ``tokenizers`` splits the
  input on its added tokens first and normalizes, pre-tokenizes and encodes each piece in
  between on its own, so a piece's ids do not depend on what precedes the added token. This
  needs added tokens without ``lstrip``/``rstrip``/``single_word`` (they would reach across the
  cut) and no pre-tokenizer that treats the input's first piece differently (``Metaspace``
  with ``prepend_scheme: first``); otherwise the cache is off.
- **inside long plain text** (a pre-tokenizer split boundary): at a space between two ASCII
  letters, the first at or after every :data:`CHUNK_CHARS` characters since the previous cut.
  For the GPT-2 family of pre-tokenizers (``ByteLevel`` with its regex, or a ``Split`` regex
  before a ``ByteLevel`` without its own, as Qwen2 and Llama 3 ship) and for
  ``Whitespace``/``WhitespaceSplit``, a letter run ends before that space and the next
  pre-token (`` word``) starts at it, in the whole text and in the segment alike; the BPE /
  WordLevel / WordPiece model encodes each pre-token on its own. Normalizers other than the
  Unicode forms and ``Lowercase`` (which map each of those three characters to itself) turn
  these cuts off.

Completions are encoded with special tokens (``tokenizer(prompt)``): the post-processor's
additions are a fixed prefix and suffix found once from a probe and checked to be exactly that;
when they are not, such prompts are encoded whole.

Whatever the structure says, the first :data:`VERIFY_FIRST` segmented encodings are checked
against the whole text's encoding; one difference turns the cache off for good (one WARNING).
The cache is an LRU over segments bounded by the token ids it holds (``--tokenizer_cache_tokens``);
a segment longer than a tenth of the bound is not kept. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

#: Plain text is cut (at a compositional boundary) about every this many characters.
CHUNK_CHARS = 512
#: Segmented encodings checked against the whole text's encoding before the cache is trusted.
VERIFY_FIRST = 64
#: A space between two ASCII letters: the plain-text cut point (the cut is before the space).
_BOUNDARY = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
#: Normalizers that map ASCII letters and the space to themselves, one character each.
_SAFE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})


@dataclass
class TokenCacheStats:
    """Counters of a :class:`SegmentTokenCache` (copied under its lock).

    :ivar encodes: texts encoded through the cache.
    :ivar segment_hits: segments whose ids came from the cache.
    :ivar segment_misses: segments tokenized.
    :ivar tokens_reused: token ids taken from the cache.
    :ivar cached_tokens: token ids held now.
    :ivar enabled: False once the structure check or a verification turned it off.
    """

    encodes: int = 0
    segment_hits: int = 0
    segment_misses: int = 0
    tokens_reused: int = 0
    cached_tokens: int = 0
    enabled: bool = True


def _components(node: Any) -> list[dict]:
    """A tokenizer.json component and, for a ``Sequence``, its members (flattened)."""
    if not isinstance(node, dict):
        return []
    members = node.get("normalizers") or node.get("pretokenizers")
    if node.get("type") == "Sequence" and isinstance(members, list):
        out: list[dict] = []
        for m in members:
            out.extend(_components(m))
        return out
    return [node]


def cut_rules(tokenizer: Any) -> tuple[bool, bool, str]:
    """Which cuts are compositional for ``tokenizer`` (a ``tokenizers.Tokenizer``), from its
    serialized structure: ``(after_added_tokens, inside_plain_text, why_not)``."""
    doc = json.loads(tokenizer.to_str())
    for added in doc.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return False, False, f"added token {added.get('content')!r} strips or is a word"
    pre = _components(doc.get("pre_tokenizer"))
    for p in pre:
        if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") == "first":
            return False, False, "Metaspace pre-tokenizer prepends to the first piece only"
    norms = _components(doc.get("normalizer"))
    if any(n.get("type") not in _SAFE_NORMALIZERS for n in norms):
        return True, False, "normalizer may change text across a plain-text cut"
    kinds = [p.get("type") for p in pre]
    safe = (kinds in (["Whitespace"], ["WhitespaceSplit"])
            or (kinds == ["ByteLevel"] and pre[0].get("use_regex", True)
                and not pre[0].get("add_prefix_space", False))
            or (kinds == ["Split", "ByteLevel"] and not pre[1].get("use_regex", True)
                and not pre[1].get("add_prefix_space", False)))
    if not safe:
        return True, False, f"pre-tokenizer {kinds} not known to split at a space"
    return True, True, ""


class SegmentTokenCache:
    """Exact, bounded tokenization of text by cached segments (see the module docstring).

    :param tokenizer: a ``tokenizers.Tokenizer`` (never reconfigured here).
    :param max_tokens: most token ids held (> 0).
    :param chunk_chars: plain text is cut about every this many characters (> 0).
    :param verify_first: segmented encodings checked against the whole text first.
    """

    def __init__(self, tokenizer: Any, max_tokens: int, chunk_chars: int = CHUNK_CHARS,
                 verify_first: int = VERIFY_FIRST) -> None:
        if max_tokens <= 0:
            raise ValueError("max_tokens must be > 0")
        self._tok = tokenizer
        self.max_tokens = max_tokens
        self._chunk = max(1, chunk_chars)
        self._lock = threading.Lock()
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._stats = TokenCacheStats()
        self._verify_left = verify_first
        self._after_added, self._inside_text, why = cut_rules(tokenizer)
        if not self._after_added:
            self._disable(f"structure: {why}")
        elif why:
            log.info("tokenizer cache: cuts after added tokens only (%s)", why)
        contents = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()),
                          key=len, reverse=True)
        # Leftmost-longest, as tokenizers matches its added tokens.
        self._added = (re.compile("|".join(re.escape(c) for c in contents))
                       if contents else None)
        self._affixes = self._special_affixes()

    def _special_affixes(self) -> Optional[tuple[list[int], list[int]]]:
        """``(prefix, suffix)`` the post-processor adds around any text, or ``None`` when its
        additions are not that (then such texts are encoded whole)."""
        probes = ("hello world", "a", "x y z 1")
        found: Optional[tuple[list[int], list[int]]] = None
        for probe in probes:
            bare = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            for start in range(len(full) - len(bare) + 1):
                if full[start:start + len(bare)] == bare:
                    pair = (full[:start], full[start + len(bare):])
                    break
            else:
                return None
            if found is not None and pair != found:
                return None
            found = pair
        return found

    def _disable(self, why: str) -> None:
        with self._lock:
            was = self._stats.enabled
            self._stats.enabled = False
            self._segments.clear()
            self._stats.cached_tokens = 0
        if was:
            log.warning("tokenizer cache off: %s; texts are tokenized whole", why)

    @property
    def enabled(self) -> bool:
        """False once turned off (structure or a failed verification)."""
        with self._lock:
            return self._stats.enabled

    def stats(self) -> TokenCacheStats:
        """A copy of the counters."""
        with self._lock:
            return TokenCacheStats(**vars(self._stats))

    def segments(self, text: str) -> list[str]:
        """``text`` cut at its compositional points (see the module docstring); the pieces
        joined give ``text`` back."""
        cuts: list[int] = []
        if self._added is not None:
            cuts.extend(m.end() for m in self._added.finditer(text))
        if self._inside_text:
            bounds = [0, *cuts, len(text)]
            extra: list[int] = []
            for lo, hi in zip(bounds, bounds[1:]):
                pos = lo + self._chunk
                while pos < hi:
                    m = _BOUNDARY.search(text, pos, hi)
                    if m is None:
                        break
                    extra.append(m.start())
                    pos = m.start() + self._chunk
            cuts = sorted(set(cuts + extra))
        out: list[str] = []
        prev = 0
        for c in cuts:
            if 0 < c < len(text) and c > prev:
                out.append(text[prev:c])
                prev = c
        out.append(text[prev:])
        return out

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``, the same as ``tokenizer.encode(text,
        add_special_tokens).ids``."""
        if not self.enabled or (add_special_tokens and self._affixes is None):
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        pieces = self.segments(text)
        if len(pieces) == 1 and not self._has(pieces[0]):
            ids = list(self._tok.encode(text, add_special_tokens=False).ids)
            self._put(pieces[0], ids, hit=False)
            return self._verified(text, add_special_tokens, self._wrap(ids, add_special_tokens))
        out: list[int] = []
        missing: list[int] = []
        found: dict[int, list[int]] = {}
        with self._lock:
            self._stats.encodes += 1
            for i, piece in enumerate(pieces):
                cached = self._segments.get(piece)
                if cached is None:
                    missing.append(i)
                else:
                    self._segments.move_to_end(piece)
                    found[i] = cached
                    self._stats.segment_hits += 1
                    self._stats.tokens_reused += len(cached)
        if missing:
            # One call for every missing segment: the Rust side encodes them in parallel.
            encoded = self._tok.encode_batch([pieces[i] for i in missing],
                                             add_special_tokens=False)
            for i, enc in zip(missing, encoded):
                fresh = list(enc.ids)
                found[i] = fresh
                self._put(pieces[i], fresh, hit=False)
        for i in range(len(pieces)):
            out.extend(found[i])
        return self._verified(text, add_special_tokens, self._wrap(out, add_special_tokens))

    def _wrap(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens or self._affixes is None:
            return ids
        prefix, suffix = self._affixes
        return [*prefix, *ids, *suffix] if (prefix or suffix) else ids

    def _has(self, piece: str) -> bool:
        with self._lock:
            return piece in self._segments

    def _put(self, piece: str, ids: list[int], hit: bool) -> None:
        if len(ids) > self.max_tokens // 10:
            return
        with self._lock:
            if not self._stats.enabled:
                return
            self._stats.segment_misses += 0 if hit else 1
            old = self._segments.pop(piece, None)
            if old is not None:
                self._stats.cached_tokens -= len(old)
            self._segments[piece] = ids
            self._stats.cached_tokens += len(ids)
            while self._stats.cached_tokens > self.max_tokens and self._segments:
                _, dropped = self._segments.popitem(last=False)
                self._stats.cached_tokens -= len(dropped)

    def _verified(self, text: str, add_special_tokens: bool, result: list[int]) -> list[int]:
        """``result``, or, while verifying, the whole text's ids when they differ (the cache
        is then turned off)."""
        with self._lock:
            if self._verify_left <= 0:
                return result
            self._verify_left -= 1
        whole = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if whole != result:
            self._disable("a segmented encoding differed from the whole text's")
            return whole
        return result
