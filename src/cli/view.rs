//! `gpumem view`: a recording in the browser, served on loopback.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use gpumem::server::hosts::view_hosts;
use gpumem::server::view::view_app;
use gpumem::server::{HttpLimits, serve, shutdown_signal};
use gpumem::view::recording::RecordingView;

use super::{CliResult, Path, ReadArgs, parse_bytes};

#[derive(clap::Args)]
pub(crate) struct Args {
    /// The snapshot: `torch.cuda.memory._dump_snapshot` pickle, or the same schema as JSON,
    /// optionally gzipped.
    trace: Path,
    /// Where to serve the page (loopback by default: the page shows the recording's frames).
    #[arg(long, default_value = "127.0.0.1:9419")]
    listen: SocketAddr,
    /// Device memory (bytes, or with a KiB/MiB/GiB suffix); default: the recorded device,
    /// else inferred from expandable reservations, else 80 GiB.
    #[arg(long, value_parser = parse_bytes)]
    capacity: Option<u64>,
    #[command(flatten)]
    pytorch: super::PyTorchArg,
    #[command(flatten)]
    read: ReadArgs,
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.read.read(&args.trace)?;
    let read_done = Instant::now();
    let name = super::file_name(&args.trace);
    let base = gpumem::replay::ReplayOptions {
        capacity: args.capacity,
        order: args.pytorch.order(),
        max_memory_bytes: Some(args.read.max_memory_bytes()),
        ..Default::default()
    };
    let view = Arc::new(RecordingView::new(Arc::new(recording), name, &base));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", args.listen))
            })?;
        let address = listener.local_addr()?;
        let hosts = view_hosts(&address.to_string(), address.port());
        eprintln!(
            "gpumem view: http://{address}/ ({} ms after reading; Ctrl-C stops)",
            read_done.elapsed().as_millis()
        );
        serve(
            listener,
            view_app(view, hosts),
            HttpLimits::default(),
            shutdown_signal(),
        )
        .await;
        Ok::<_, std::io::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}
