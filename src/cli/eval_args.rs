//! `train`'s held-out evaluation flags: which data is scored (`--eval-data`, or `--eval-split`
//! of `--data`), how much of it and how often.

use super::data_args::DataArgs;
use anyhow::{bail, Context};
use std::path::PathBuf;
use zerodp::data::{
    split_documents, DataLoader, EvalWindows, ExampleLoader, HeldOutData, TextTokenizer, TrainData,
};
use zerodp::model::GptConfig;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct EvalArgs {
    /// Held-out data, scored after the last step and every --eval-every steps: the formats of
    /// --data, encoded as --data is, cut into consecutive windows of context + 1 tokens.
    #[arg(long = "eval-data", value_name = "FILE_OR_DIR", num_args = 1.., conflicts_with = "eval_split")]
    pub eval_data: Vec<PathBuf>,
    /// Hold out this fraction of --data's documents (a seeded choice, by --seed), never trained
    /// on, and score them as --eval-data. Documents: those of a token file; paragraphs of a
    /// byte corpus.
    #[arg(long, value_name = "F")]
    pub eval_split: Option<f64>,
    /// Also score the held-out data after every N optimizer steps [default: only after the
    /// last].
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Score only the first K held-out windows [default: all of them].
    #[arg(long, value_name = "K")]
    pub eval_windows: Option<usize>,
}

impl EvalArgs {
    /// Whether held-out data is asked for.
    pub fn wanted(&self) -> bool {
        !self.eval_data.is_empty() || self.eval_split.is_some()
    }

    /// The training loader and, when asked for, the held-out windows: `--eval-split`'s held-out
    /// documents (the loader then reads the rest), or `--eval-data`'s stream.
    pub fn data(
        &self,
        data: &DataArgs,
        tokenizer: Option<&TextTokenizer>,
        (gpt, seed, on_cpu): (&GptConfig, u64, bool),
        flags: (bool, bool),
    ) -> anyhow::Result<(TrainData, Option<HeldOutData>)> {
        self.check()?;
        if let Some(examples) = data.examples(&data.paths, tokenizer, (gpt, seed, on_cpu))? {
            let shape = (gpt, seed, on_cpu);
            let (train, held) = self.held_out_examples(examples, data, tokenizer, shape)?;
            return Ok((TrainData::Examples(train), held.map(HeldOutData::Examples)));
        }
        let (loader, held) = self.windows_data(data, tokenizer, (gpt, seed), flags)?;
        Ok((TrainData::Windows(loader), held.map(HeldOutData::Windows)))
    }

    /// Chat data: the training examples and, when asked for, the held-out ones (`--eval-split`
    /// of them, or `--eval-data`'s, which must be chat data too).
    fn held_out_examples(
        &self,
        examples: ExampleLoader,
        data: &DataArgs,
        tokenizer: Option<&TextTokenizer>,
        (gpt, seed, on_cpu): (&GptConfig, u64, bool),
    ) -> anyhow::Result<(ExampleLoader, Option<ExampleLoader>)> {
        let limit = |e: ExampleLoader| match self.eval_windows {
            Some(k) => e.take(k),
            None => e,
        };
        if let Some(fraction) = self.eval_split {
            let (train, held) = examples.split(fraction, seed)?;
            return Ok((train, Some(limit(held))));
        }
        if self.eval_data.is_empty() {
            return Ok((examples, None));
        }
        // The training data scored (`zerodp eval`): tokenized once.
        if self.eval_data == data.paths {
            let held = examples.copy();
            return Ok((examples, Some(limit(held))));
        }
        let held = data.examples(&self.eval_data, tokenizer, (gpt, seed, on_cpu))?;
        let Some(held) = held else {
            bail!("--data is chat or instruction data, so --eval-data must be too (JSONL of messages or prompt/completion)");
        };
        Ok((examples, Some(limit(held))))
    }

    /// Text data: the training windows and the held-out ones.
    fn windows_data(
        &self,
        data: &DataArgs,
        tokenizer: Option<&TextTokenizer>,
        (gpt, seed): (&GptConfig, u64),
        flags: (bool, bool),
    ) -> anyhow::Result<(DataLoader, Option<EvalWindows>)> {
        let source = data.source(tokenizer, flags)?;
        if let Some(fraction) = self.eval_split {
            let split = split_documents(source, fraction, seed)?;
            if flags.0 {
                errln!(
                    "eval: holding out {} of {} documents of --data (--eval-split {fraction}, \
                     seed {seed}); training on the other {}",
                    split.held_out_documents,
                    split.held_out_documents + split.train_documents,
                    split.train_documents
                );
            }
            let held = self.windows(split.held_out, gpt, "--eval-split's held-out part")?;
            return Ok((data.loader_over(split.train, gpt, seed)?, Some(held)));
        }
        if self.eval_data.is_empty() {
            return Ok((data.loader_over(source, gpt, seed)?, None));
        }
        // The training data scored (`zerodp eval`): read and checked once, shared.
        if self.eval_data == data.paths {
            let (train, held) = zerodp::data::held_out::shared(source);
            let held = self.windows(held, gpt, "--eval-data")?;
            return Ok((data.loader_over(train, gpt, seed)?, Some(held)));
        }
        let loader = data.loader_over(source, gpt, seed)?;
        let source = data.source_of(&self.eval_data, ("--eval-data", false), tokenizer, flags)?;
        source.check_vocab(gpt.vocab_size)?;
        Ok((loader, Some(self.windows(source, gpt, "--eval-data")?)))
    }

    fn windows(
        &self,
        source: zerodp::data::TokenSource,
        gpt: &GptConfig,
        what: &str,
    ) -> anyhow::Result<EvalWindows> {
        EvalWindows::new(source, gpt.context, self.eval_windows).with_context(|| {
            format!(
                "{what} cannot fill one window of {} tokens (shorter windows are --context N)",
                gpt.context
            )
        })
    }

    /// Flags that need held-out data, and counts that must be positive.
    fn check(&self) -> anyhow::Result<()> {
        if !self.wanted() {
            let set = [
                ("--eval-every", self.eval_every.is_some()),
                ("--eval-windows", self.eval_windows.is_some()),
            ];
            if let Some((flag, _)) = set.iter().find(|(_, on)| *on) {
                bail!("{flag} needs held-out data: --eval-data FILE_OR_DIR or --eval-split F");
            }
        }
        if self.eval_every == Some(0) {
            bail!("--eval-every 0: give a number of steps of at least 1");
        }
        if self.eval_windows == Some(0) {
            bail!("--eval-windows 0: give a number of windows of at least 1");
        }
        Ok(())
    }
}
