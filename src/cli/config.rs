//! `zerodp config` (being built; see the issue tracker).

#[derive(clap::Args, Debug)]
pub struct CheckArgs {}

pub fn run(_args: CheckArgs) -> anyhow::Result<i32> {
    anyhow::bail!("this command is not built yet")
}
