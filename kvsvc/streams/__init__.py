"""Per-stream KV-event ingestion: wire framing (``frame``), event decoding (``decoder``), the
snapshot client (``snapshot``) and the subscriber thread with its recovery state machine
(``subscriber``). Stream state values shared with the directory live in ``state``."""
