//! `zerodp plan` (being built; see the issue tracker).

#[derive(clap::Args, Debug)]
pub struct PlanArgs {}

pub fn run(_args: PlanArgs) -> anyhow::Result<i32> {
    anyhow::bail!("this command is not built yet")
}
