//! `zerodp train` (being built; see the issue tracker).

#[derive(clap::Args, Debug)]
pub struct TrainArgs {}

pub fn run(_args: TrainArgs) -> anyhow::Result<i32> {
    anyhow::bail!("this command is not built yet")
}
