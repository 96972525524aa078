//! Data: the byte corpus, tokenized text and JSONL in a cached token file, seeded windows, chat and
//! instruction data's ids and trained masks (`src/data`).

mod chat;
mod packing;
mod token_data;
mod token_data_cli;
mod windows;
