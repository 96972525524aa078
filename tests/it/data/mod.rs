//! Data: the byte corpus, tokenized text and JSONL in a cached token file, seeded windows (`src/data`).

mod token_data;
mod token_data_cli;
mod windows;
