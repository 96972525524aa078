//! `zerodp bench comm` (being built; see the issue tracker).

#[derive(clap::Args, Debug)]
pub struct BenchCommArgs {}

pub fn run(_args: BenchCommArgs) -> anyhow::Result<i32> {
    anyhow::bail!("this command is not built yet")
}
