//! `zerodp bench train` (being built; see the issue tracker).

#[derive(clap::Args, Debug)]
pub struct BenchTrainArgs {}

pub fn run(_args: BenchTrainArgs) -> anyhow::Result<i32> {
    anyhow::bail!("this command is not built yet")
}
