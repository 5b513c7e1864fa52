"""Text -> token shards, never importing torch: one streaming pass with bounded memory, resumable after a kill with
the same bytes (prepare.py runs it, encode.py is the pass, shards.py the format; docs/data.md)."""
