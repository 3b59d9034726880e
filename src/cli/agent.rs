//! `gpumem demo` and `gpumem serve`: the node agent, on a simulated node or on real GPUs.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use gpumem::AllocatorConfig;
use gpumem::ingest::IngestConfig;
use gpumem::metrics::{ReportReader, allocator_sources};
use gpumem::server::{AppState, agent_state, app, bind, serve, shutdown_signal};
use gpumem::telemetry::{NvmlSource, Poller, SimNode, SimNodeConfig};

use super::{CliResult, parse_bytes};

/// The agent's port: clear of DCGM (9400), node_exporter (9100) and the other GPU exporters.
const DEFAULT_LISTEN: &str = "127.0.0.1:9417";

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to serve /metrics on (the chart sets 0.0.0.0:9417).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Seconds between NVML polls.
    #[arg(long, default_value_t = 5.0, value_parser = parse_interval)]
    interval: f64,
}

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// Address to serve /metrics on.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Seconds between two steps of the simulated processes' replay.
    #[arg(long, default_value_t = 0.1, value_parser = parse_interval)]
    interval: f64,
    /// Simulated GPUs.
    #[arg(long, default_value_t = 2)]
    gpus: u32,
    /// Memory per simulated GPU (bytes, or with a KiB/MiB/GiB suffix).
    #[arg(long, default_value = "80GiB", value_parser = parse_bytes)]
    capacity: u64,
    /// Simulated processes per GPU, each replaying a recorded training or inference trace.
    #[arg(long, default_value_t = 3)]
    processes_per_gpu: u32,
    /// Replay speed relative to the recordings' own pace.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Allocator settings of the simulated processes (PYTORCH_CUDA_ALLOC_CONF syntax).
    #[arg(long, default_value = "")]
    config: String,
}

fn parse_interval(text: &str) -> Result<f64, String> {
    let seconds: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(0.01..=3600.0).contains(&seconds) {
        return Err("the interval must be between 0.01 and 3600 seconds".into());
    }
    Ok(seconds)
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    // One thread: scrapes are short and serial, and the agent should stay small on a GPU
    // node (sources are polled on threads of their own).
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

fn run_server(listen: SocketAddr, state: AppState) -> CliResult {
    runtime()?.block_on(async move {
        let listener = bind(listen).await?;
        serve(listener, app(state), shutdown_signal()).await
    })?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn serve_command(args: ServeArgs) -> CliResult {
    let poller = Poller::start(
        Box::new(NvmlSource::new()),
        Duration::from_secs_f64(args.interval),
    );
    let reader: ReportReader = Box::new(poller.reader());
    let state = agent_state(
        allocator_sources(Vec::new()),
        vec![reader],
        IngestConfig::default(),
    )?;
    run_server(args.listen, state)
}

pub(crate) fn demo_command(args: DemoArgs) -> CliResult {
    let node = SimNode::start(SimNodeConfig {
        gpus: args.gpus,
        capacity: args.capacity,
        processes_per_gpu: args.processes_per_gpu,
        speed: args.speed,
        tick: Duration::from_secs_f64(args.interval),
        config: AllocatorConfig::parse(&args.config)?,
        ..SimNodeConfig::default()
    })?;
    tracing::info!(
        gpus = args.gpus,
        processes_per_gpu = args.processes_per_gpu,
        "simulated node replaying recorded traces"
    );
    let reader: ReportReader = Box::new(node.report_reader());
    let state = agent_state(
        allocator_sources(node.allocator_sources()),
        vec![reader],
        IngestConfig::default(),
    )?;
    let result = run_server(args.listen, state);
    drop(node);
    result
}
