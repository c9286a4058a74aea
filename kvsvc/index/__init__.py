"""Content keys (``keys``, §4) and the per-stream tiered prefix index with its prefix walk
(``tier_index``, §5)."""
