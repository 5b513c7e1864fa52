"""Text to token shards: never imports torch. One pass over the corpus, with bounded memory whatever its size:

    sources.py: files or URLs --read in pieces of <= PIECE_CHARS--> batches of ~BATCH_CHARS text
            --tokenizer.encode_batch (parallel, inside the Rust library)--> token ids
            --> train/val shard buffers --> shards written atomically --> meta.json last

prepare.py runs a tokenize call (options, resume, meta.json), encode.py the pass, shards.py is the format. A
document (a .txt file, a .jsonl line, a parquet row, or a conversation) goes to train or val by a hash of (file
identity, document index), so wherever the file is read from; a few plain text files are split by their tails.
Resume: `prepare_state.json`, written atomically at every completed shard, holds those shards and the input
position of the batch that completed them; a killed run restarts there and writes the same bytes. Bad input:
invalid UTF-8 is replaced by U+FFFD and counted; empty files and documents, unreadable parquet files or row groups
(on_bad_file="skip", else an error) and malformed conversations are skipped and reported; a missing column is an
error naming the file and the available names. More in docs/data.md.
"""
