//! `train`'s pre-flight flags; the check itself is [`zerodp::planner::preflight`].

#[derive(clap::Args, Debug, Clone, Default)]
pub struct PreflightArgs {
    /// Memory each rank may use (its device tier), checked before the run starts and held to by
    /// the engine: 2GiB, 500MB [default: zerodp.device_memory, else this machine's total memory
    /// (/proc/meminfo, or the process's cgroup or ulimit -v limit if lower) divided by
    /// --world-size].
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
}
