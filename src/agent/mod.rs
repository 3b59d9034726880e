//! The node agent, composed once. `gpumem serve` (real GPUs), `gpumem demo` (a simulated
//! node), gpumem-torch's endpoint (inside a PyTorch process, over its own allocators) and the
//! tests build an [`Agent`] and run it or route requests to it.
//!
//! An agent is the server's [`AppState`] (the metrics over the allocator sources and the
//! telemetry's reports, the ingest of pushes where it takes them, the limits, the loops its
//! probes report on), the loops it owns (the kubelet's watch, the expiry tick of pushed
//! processes) and, when run, its listeners ([`Listen`]). Pollers of the node (NVML, the
//! simulated node) run on threads of their own, started by the caller; the agent's probes
//! watch their heartbeats ([`Agent::watch`]).
//!
//! # Invariants
//! - Ended pushing processes expire on the agent's own tick ([`EXPIRY_TICK`]), whether or not
//!   anyone scrapes.
//! - The push socket and the push-only listener answer pushes, uploads and probes, never
//!   `/metrics` or the page: pods that mount the socket are tenants, not scrapers.
//! - The push socket is optional: where it cannot be bound, the agent warns and takes pushes
//!   over loopback.
//! - Every listener stops on the one stop signal, giving requests in flight the limits'
//!   shutdown timeout; where the agent archives its recordings, the archiving goes on
//!   after the listeners have stopped, for at most its grace (`archive::uploader`), and
//!   [`Agent::run`] returns when it is done.

mod kubelet;

pub use kubelet::{KUBELET_MIN_INTERVAL, KubeletWatch};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;

#[cfg(feature = "tools")]
use crate::demo::SimNode;
use crate::ingest::{IngestConfig, PushStore};
use crate::metrics::{Metrics, ReportReader};
use crate::server::{self, AppState, HttpLimits};
use crate::sources::{AllocatorSources, IngestReader};
use crate::telemetry::{Heartbeat, Kubelet};

/// How often ended pushing processes are looked for.
pub const EXPIRY_TICK: Duration = Duration::from_secs(1);

/// A node agent: what its handlers share, and the loops it runs beside them.
pub struct Agent {
    /// What the handlers share: set its limits, names and credentials before running.
    pub state: AppState,
    kubelet: Option<KubeletWatch>,
    /// The archiving of kept recordings, and the time it is given after the stop signal.
    #[cfg(feature = "archive")]
    archiving: Option<(Arc<crate::archive::uploader::Uploads>, Duration)>,
}

/// Where and how an agent serves.
#[derive(Clone, Debug)]
pub struct Listen {
    /// `/metrics`, the page and pushes.
    pub address: SocketAddr,
    /// TLS on `address`, where configured.
    #[cfg(feature = "tls")]
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// A plain-HTTP listener for pushes only (beside a TLS one, for jobs on the pod network).
    pub push_address: Option<SocketAddr>,
    /// The push socket, where there is one.
    pub push_socket: Option<PathBuf>,
    /// How long to wait for the socket's directory to appear.
    pub socket_wait: Duration,
    /// Connection and time limits, per listener.
    pub limits: HttpLimits,
}

impl Listen {
    /// Plain HTTP on `address` only, within the default limits.
    pub fn on(address: SocketAddr) -> Listen {
        Listen {
            address,
            #[cfg(feature = "tls")]
            tls: None,
            push_address: None,
            push_socket: None,
            socket_wait: Duration::ZERO,
            limits: HttpLimits::default(),
        }
    }
}

impl Agent {
    /// A node's agent: metrics over `sources` and the telemetry's `reports` (with what the
    /// `kubelet` says, where it says), taking pushes from this host into `sources` under
    /// `ingest`.
    ///
    /// # Errors
    /// A registration error, which only a collector defect can cause.
    pub fn node(
        sources: AllocatorSources,
        reports: Vec<ReportReader>,
        ingest: IngestConfig,
        kubelet: Kubelet,
    ) -> Result<Agent, prometheus::Error> {
        let store = Arc::new(PushStore::new(ingest, sources.clone()));
        let reader: IngestReader = {
            let store = Arc::clone(&store);
            Arc::new(move || store.report())
        };
        let pod_names = kubelet.names.clone();
        let metrics = Metrics::new(sources.clone(), reports, Some(reader), kubelet)?;
        let mut state = AppState::new(Arc::new(metrics), Some(store));
        state.sources = sources;
        state.pod_names = pod_names;
        Ok(Agent {
            state,
            kubelet: None,
            #[cfg(feature = "archive")]
            archiving: None,
        })
    }

    /// The agent of a process holding its own allocators (gpumem-torch's endpoint): metrics
    /// over `sources` and the page with their segment maps; no pushes, no node telemetry.
    ///
    /// # Errors
    /// A registration error, which only a collector defect can cause.
    pub fn in_process(sources: AllocatorSources) -> Result<Agent, prometheus::Error> {
        let metrics = Metrics::new(sources.clone(), Vec::new(), None, Kubelet::default())?;
        let mut state = AppState::new(Arc::new(metrics), None);
        state.sources = sources;
        Ok(Agent {
            state,
            kubelet: None,
            #[cfg(feature = "archive")]
            archiving: None,
        })
    }

    /// A node's agent as [`Agent::node`], with what the kubelet says as `watch` reads it on
    /// the agent's runtime (`gpumem serve`); its probes report on the watch.
    ///
    /// # Errors
    /// A registration error, which only a collector defect can cause.
    pub fn watching(
        sources: AllocatorSources,
        reports: Vec<ReportReader>,
        ingest: IngestConfig,
        watch: KubeletWatch,
    ) -> Result<Agent, prometheus::Error> {
        let mut agent = Agent::node(sources, reports, ingest, watch.kubelet.clone())?;
        agent.watch(watch.heartbeat.clone());
        agent.kubelet = Some(watch);
        Ok(agent)
    }

    /// The agent of a simulated node (`gpumem demo`): metrics over `node`'s allocators and
    /// its view of the node, with its kubelet's names, taking pushes under `ingest`; its
    /// replay loop is watched.
    ///
    /// # Errors
    /// A registration error, which only a collector defect can cause.
    #[cfg(feature = "tools")]
    pub fn simulated(node: &SimNode, ingest: IngestConfig) -> Result<Agent, prometheus::Error> {
        let reader: ReportReader = Box::new(node.report_reader());
        let sources = AllocatorSources::new(node.allocator_sources());
        let mut agent = Agent::node(sources, vec![reader], ingest, node.kubelet())?;
        agent.watch(node.heartbeat());
        Ok(agent)
    }

    /// Where pushes go, where the agent takes them.
    pub fn ingest(&self) -> Option<&Arc<PushStore>> {
        self.state.ingest.as_ref()
    }

    /// Archives the kept recordings through `uploads` while running, and for at most
    /// `grace` after the stop signal; pods known by UID only are named as the agent names
    /// them (the kubelet's log directories).
    #[cfg(feature = "archive")]
    pub fn archive(&mut self, uploads: crate::archive::uploader::Uploads, grace: Duration) {
        let uploads = Arc::new(uploads.with_names(self.state.pod_names.clone()));
        self.state.uploads = Some(Arc::clone(&uploads));
        self.archiving = Some((uploads, grace));
    }

    /// Reports on `beat`'s loop in `/healthz` and `/readyz`.
    pub fn watch(&mut self, beat: Heartbeat) {
        self.state.health.watch(beat);
    }

    /// The router of the main listener: `/metrics`, the page, pushes and probes.
    pub fn router(&self) -> Router {
        server::app(self.state.clone())
    }

    /// Serves on `listen` until `stop` completes, with the agent's loops beside: call it on
    /// a Tokio runtime (with time and I/O). Returns once every listener has stopped.
    ///
    /// # Errors
    /// A listener that cannot be bound (the push socket excepted: see the module's
    /// invariants).
    pub async fn run(
        self,
        listen: Listen,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        #[cfg(feature = "archive")]
        let Agent {
            state,
            kubelet,
            archiving,
        } = self;
        #[cfg(not(feature = "archive"))]
        let Agent { state, kubelet } = self;
        // The agent's loops stop with its listeners (on a caller's runtime too).
        let mut loops = tokio::task::JoinSet::new();
        if let Some(watch) = kubelet {
            loops.spawn(watch.run());
        }
        if let Some(store) = state.ingest.clone() {
            loops.spawn(async move {
                let mut ticks = tokio::time::interval(EXPIRY_TICK);
                loop {
                    ticks.tick().await;
                    store.expire();
                }
            });
        }
        let listener = server::bind(listen.address).await?;
        let push_listener = match listen.push_address {
            Some(address) => Some(server::bind(address).await?),
            None => None,
        };
        let unix = match &listen.push_socket {
            Some(path) => match server::bind_unix(path, listen.socket_wait).await {
                Ok(listener) => Some(listener),
                Err(e) => {
                    tracing::warn!(error = %e, "no push socket");
                    eprintln!("gpumem: warning: {e}; pushes are accepted from loopback only");
                    None
                }
            },
            None => None,
        };
        let push_router = server::push_app(state.clone());
        let router = server::app(state);
        let (tell, told) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            stop.await;
            let _ = tell.send(true);
        });
        // The archiving goes on until the listeners have stopped (an upload they were still
        // reading is archived too).
        #[cfg(feature = "archive")]
        let (listening, listeners_stopped) = tokio::sync::watch::channel(false);
        #[cfg(feature = "archive")]
        let archiving = archiving.map(|(uploads, grace)| {
            tokio::spawn(uploads.run(told.clone(), listeners_stopped, grace))
        });
        let stopped = move || {
            let mut told = told.clone();
            async move {
                let _ = told.wait_for(|&stopped| stopped).await;
            }
        };
        let limits = listen.limits;
        let main = async {
            #[cfg(feature = "tls")]
            if let Some(tls) = listen.tls {
                return server::serve_tls(listener, tls, router, limits, stopped()).await;
            }
            server::serve(listener, router, limits, stopped()).await;
        };
        let pushes = async {
            if let Some(listener) = push_listener {
                server::serve(listener, push_router.clone(), limits, stopped()).await;
            }
        };
        let socket = async {
            if let Some(listener) = unix {
                server::serve_unix(listener, push_router.clone(), limits, stopped()).await;
            }
        };
        tokio::join!(main, pushes, socket);
        loops.abort_all();
        #[cfg(feature = "archive")]
        if let Some(archiving) = archiving {
            let _ = listening.send(true);
            let _ = archiving.await;
        }
        Ok(())
    }

    /// Runs the agent on a runtime of its own until the process is told to stop (SIGINT,
    /// SIGTERM): `gpumem serve` and `gpumem demo`.
    ///
    /// # Errors
    /// The runtime cannot start, or a listener cannot be bound.
    pub fn run_until_signalled(self, listen: Listen) -> std::io::Result<()> {
        // One thread: scrapes are short and serial, and the agent should stay small on a GPU
        // node (sources are polled on threads of their own).
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(self.run(listen, server::shutdown_signal()))
    }
}
