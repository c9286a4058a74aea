"""kvsvc: a KV-cache-aware router and KV-event directory for LLM serving clusters.

Data path, one module each: socket (``streams.subscriber``) -> frame (``streams.frame``)
-> event (``streams.decoder``, types in ``events``) -> index (``index.keys``,
``index.tier_index``) -> directory (``directory``) -> HTTP (``app``).
The wire and behaviour specification is ``PROTOCOL.md`` (cited as §N).
"""

__version__ = "0.1.0"
