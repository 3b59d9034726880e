//! `gpumem view`: a recording in the browser, served on loopback.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use gpumem::server::hosts::view_hosts;
use gpumem::server::view::view_app;
use gpumem::server::{HttpLimits, serve, shutdown_signal};
use gpumem::view::recording::RecordingView;

use super::{CliResult, RecordingArgs};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    recording: RecordingArgs,
    /// Where to serve the page (loopback by default: the page shows the recording's frames).
    #[arg(long, default_value = "127.0.0.1:9419")]
    listen: SocketAddr,
}

pub(crate) fn run(args: Args) -> CliResult {
    let recording = args.recording.read()?;
    let read_done = Instant::now();
    // Every device's session takes the memory, order and budget asked for.
    let setup = args.recording.setup(0);
    let view = Arc::new(RecordingView::new(recording, args.recording.name(), setup));
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
