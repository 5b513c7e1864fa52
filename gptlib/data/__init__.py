"""Text to token shards: never imports torch.

The pipeline, in one pass over the corpus and with bounded memory whatever its size:

    sources.py: files or URLs --read in pieces of <= PIECE_CHARS--> batches of ~BATCH_CHARS text
            --tokenizer.encode_batch (parallel, inside the Rust library)--> token ids
            --> train/val shard buffers --> shards written atomically --> meta.json last
    (encode.py runs the pass; shards.py is the format)

- Inputs: files, directories and globs, and fsspec URLs: file://, memory://, s3://, and Hub datasets
  hf://datasets/OWNER/NAME[/glob] (hub.py: the dataset's parquet files, streamed row group by row
  group, never downloaded whole). A network error is retried with backoff and the file re-read from
  the last completed row group (remote.py).
- Documents: a .txt file is one document, a .jsonl line is one (its `text_column` field), a
  parquet row is one (its `text_column` column). Documents are separated by the tokenizer's
  end-of-text id (the char tokenizer has none: documents are simply concatenated).
- format="chat": a document is a conversation (a record whose field holds a list of messages),
  rendered with chat.py's template (role markers are special tokens); the assistant spans are
  stored beside each shard, for a fine-tuning loss on assistant tokens only.
- Validation split: per document by a deterministic hash of (file identity, document index), so
  the same document always lands in the same split, wherever the file is read from. A corpus of a
  few plain text files (e.g. Tiny Shakespeare, one document) uses the tail of each file instead
  (split="tail").
- max_tokens: stop at the first document end at or after that many tokens (train + val).
- Memory: text is read in pieces (a 100 MB line is never one string unless it is one JSON
  value), token ids go straight into one fixed-size buffer per split; peak RSS is about one
  train shard buffer + one encode batch.
- Resume: a `prepare_state.json` is written (atomically) after every completed shard; it holds
  the completed shards and the input position of the batch that completed them. A killed run
  restarts from there, drops the few tokens that the completed shards already hold, and goes
  on. `meta.json` is written last, so a half-written dataset never looks complete.
- Bad input: invalid UTF-8 is replaced by U+FFFD and counted; empty files and empty documents
  are skipped and counted; an unreadable parquet file (or row group) is skipped with a report
  (on_bad_file="skip") or is an error (on_bad_file="error"); a missing column/field is an error
  naming the file and the available names; malformed conversations are skipped, counted and shown.
"""
