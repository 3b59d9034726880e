//! Listening: binding the TCP address and the push socket, and serving connections within
//! stated limits.
//!
//! # Invariants (budgets)
//! - At most [`HttpLimits::max_connections`] connections are served at once per listener;
//!   a new one is always accepted, and another closed to make room (`conns.rs`: one not
//!   serving a request, of the owner holding most, the least recently progressed): idle
//!   connections cannot keep a probe out, nor a crowd another owner's request.
//! - A connection that does not send a request's headers within
//!   [`HttpLimits::header_timeout`], whether new or idle between keep-alive requests, is
//!   closed; one that keeps a response waiting and reads less than 1 MiB of it per
//!   [`HttpLimits::send_timeout`] is closed too: so a slow or idle client holds its slot (and
//!   a response body) only that long.
//! - A TLS listener ([`serve_tls`]) holds a handshake to the header timeout (the request's
//!   headers then get their own), in the connection's own task: a client that never finishes
//!   it holds only its connection.
//! - Shutdown stops accepting at once, lets the requests in flight finish, and returns
//!   within [`HttpLimits::shutdown_timeout`] whatever the clients do.
//! - A push socket that another agent still answers on is not taken at once: binding waits
//!   for it to go (an update that starts the new agent first, a second agent by mistake), up
//!   to a bound, then takes the socket over saying so. An agent removes the socket file at
//!   exit only if it is still its own, never a successor's.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tower::ServiceExt;

use super::conns::{Connection, Connections, Owner};
use super::pidfd::{PeerHandle, PidFd};
use crate::ingest::Peer;

/// The limits within which connections are served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time to send a request's headers, from connecting or from the previous response.
    pub header_timeout: Duration,
    /// Time a client may leave a response unread (no byte of it accepted) before the
    /// connection is closed.
    pub send_timeout: Duration,
    /// Connections served at once on one listener (beyond it, the least recently
    /// progressed is closed).
    pub max_connections: usize,
    /// Time given to the requests in flight when shutting down.
    pub shutdown_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_secs(10),
            // Scrapers and pushers each open one connection at a time; two listeners of 384
            // stay under the usual limit of 1024 open files.
            max_connections: 384,
            shutdown_timeout: Duration::from_secs(5),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then lets the requests in flight
/// finish (within the limit). Requests carry the peer's address as `ConnectInfo`, and their
/// [`Connection`] as an extension. Accept errors are retried (as axum does), so serving
/// itself never fails.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_tcp(listener, app, limits, shutdown, None).await;
}

/// Serves `app` over TLS on `listener` (as [`serve`] does, the handshake included in each
/// connection's limits).
#[cfg(feature = "tls")]
pub async fn serve_tls(
    listener: TcpListener,
    tls: std::sync::Arc<rustls::ServerConfig>,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let tls = Some(tokio_rustls::TlsAcceptor::from(tls));
    serve_tcp(listener, app, limits, shutdown, tls).await;
}

/// A TCP listener's connections: known by the peer's address, owned by no process.
async fn serve_tcp(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
    tls: Option<Tls>,
) {
    let info = |_: &_, addr: SocketAddr| (addr, Some(Owner::address(addr.ip().to_canonical())));
    serve_with(listener, app, limits, shutdown, info, || {}, tls).await;
}

/// Serves `app` on a Unix socket until `shutdown` completes; pushes over it are attributed to
/// the connecting process's pid. At shutdown the socket file is removed, before the requests
/// in flight finish, and only if it is still this listener's (a successor that took it over
/// keeps its own).
pub async fn serve_unix(
    listener: UnixListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    use std::os::unix::fs::MetadataExt;
    super::pidfd::raise_open_files();
    let own = listener
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf))
        .and_then(|path| {
            let meta = std::fs::metadata(&path).ok()?;
            Some((path, meta.dev(), meta.ino()))
        });
    let remove_own = move || {
        if let Some((path, dev, ino)) = own
            && std::fs::metadata(&path).is_ok_and(|m| m.dev() == dev && m.ino() == ino)
        {
            let _ = std::fs::remove_file(&path);
        }
    };
    serve_with(
        listener,
        app,
        limits,
        shutdown,
        |io: &UnixStream, _| {
            let peer = UnixPeer::of(io);
            let owner = peer.owner;
            (peer, owner)
        },
        remove_own,
        None,
    )
    .await;
}

/// What accepts a TLS listener's handshakes (none without the feature `tls`).
#[cfg(feature = "tls")]
type Tls = tokio_rustls::TlsAcceptor;
#[cfg(not(feature = "tls"))]
#[derive(Clone)]
enum Tls {}

async fn serve_with<L, C>(
    mut listener: L,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
    info: impl Fn(&L::Io, L::Addr) -> (C, Option<Owner>),
    stopped: impl FnOnce(),
    tls: Option<Tls>,
) where
    L: Listener,
    C: Clone + Send + Sync + 'static,
{
    let connections = Connections::new(limits.max_connections);
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let (io, addr) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (peer, owner) = info(&io, addr);
        let admitted = connections.admit(owner);
        let conn = admitted.connection().clone();
        let app = app.clone();
        let tagged = conn.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer.clone()));
            request.extensions_mut().insert(tagged.clone());
            // Until its answer is made, the request is not a connection to evict first.
            let serving = tagged.serving();
            let answered = app.clone().oneshot(request);
            async move {
                let response = answered.await;
                drop(serving);
                response
            }
        });
        let io = Watched::new(io, conn.clone(), limits.send_timeout);
        let (watcher, http, tls) = (graceful.watcher(), http.clone(), tls.clone());
        let served = async move {
            match tls {
                None => {
                    let _ = watcher
                        .watch(http.serve_connection(TokioIo::new(io), service))
                        .await;
                }
                #[cfg(not(feature = "tls"))]
                Some(never) => match never {},
                #[cfg(feature = "tls")]
                Some(tls) => {
                    let handshake = tokio::time::timeout(limits.header_timeout, tls.accept(io));
                    match handshake.await {
                        Ok(Ok(io)) => {
                            let _ = watcher
                                .watch(http.serve_connection(TokioIo::new(io), service))
                                .await;
                        }
                        // A client's certificate trouble shows here (the API server's, say).
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
        };
        tokio::spawn(async move {
            // A client's error (a timeout, a reset, a failed handshake) ends its connection
            // only; an eviction drops it with its request.
            tokio::select! {
                () = served => {}
                () = conn.evicted() => {}
            }
            drop(admitted);
        });
    }
    stopped();
    drop(listener);
    if tokio::time::timeout(limits.shutdown_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            timeout = ?limits.shutdown_timeout,
            "connections still open at shutdown were closed"
        );
    }
}

/// Bytes a client that keeps the agent waiting must read per send timeout.
const MIN_PROGRESS: usize = 1 << 20;

/// A connection's I/O stream, telling its [`Connection`] of each byte read or written, whose
/// writes fail when a client keeps them waiting and reads less than [`MIN_PROGRESS`] per
/// `limit`: a client that stops reading, or trickles, cannot hold a response (and its
/// memory) for long.
struct Watched<T> {
    io: T,
    conn: Connection,
    limit: Duration,
    /// Started when a write could not proceed; cleared once enough was written since.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Bytes written since the timer started.
    progress: usize,
}

impl<T> Watched<T> {
    fn new(io: T, conn: Connection, limit: Duration) -> Self {
        Watched {
            io,
            conn,
            limit,
            stalled: None,
            progress: 0,
        }
    }

    /// After a write that proceeded: enough progress clears the timer.
    fn progressed(&mut self, written: usize) {
        if written > 0 {
            self.conn.progressed();
        }
        if self.stalled.is_some() {
            self.progress += written;
            if self.progress >= MIN_PROGRESS {
                self.stalled = None;
                self.progress = 0;
            }
        }
    }

    /// After a write returned `Pending`: an error once the stall has lasted `limit`.
    fn check(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<usize>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client stopped reading",
            ))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Watched<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.progressed();
        }
        read
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match std::pin::Pin::new(&mut self.io).poll_write(cx, buf) {
            std::task::Poll::Pending => self.check(cx),
            std::task::Poll::Ready(Ok(n)) => {
                self.progressed(n);
                std::task::Poll::Ready(Ok(n))
            }
            ready => ready,
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match std::pin::Pin::new(&mut self.io).poll_flush(cx) {
            std::task::Poll::Pending => self.check(cx).map_ok(|_| ()),
            ready => ready,
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs) {
            std::task::Poll::Pending => self.check(cx),
            std::task::Poll::Ready(Ok(n)) => {
                self.progressed(n);
                std::task::Poll::Ready(Ok(n))
            }
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}

/// Binds `address`, logging where the agent listens.
///
/// # Errors
/// The bind error, with the address.
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {address}: {e}")))?;
    if let Ok(local) = listener.local_addr() {
        tracing::info!(address = %local, "serving /metrics");
        eprintln!("gpumem: serving http://{local}/metrics");
    }
    Ok(listener)
}

/// How often a live agent's socket is tried again while waiting to take it over.
const TAKEOVER_POLL: Duration = Duration::from_millis(250);

/// Binds a Unix socket at `path` for pushes from any local user: creates its directory
/// (`0755`: only the agent writes there; a directory others may write, or own, is warned
/// about),
/// replaces a socket left by an agent that no longer answers on it (never another kind of
/// file), and makes it connectable by all (access is already limited to whoever can reach the
/// path). While another agent answers on `path`, waits up to `wait` for it to go (a rolling
/// update starts the new agent before stopping the old), then takes the socket over.
///
/// # Errors
/// The error, with the path.
pub async fn bind_unix(path: &Path, wait: Duration) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let context = |e: std::io::Error| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}", path.display()),
        )
    };
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    // Only the agent writes there: jobs connect (through a read-only mount), and one that
    // could write could replace the socket with its own.
    if let Some(parent) = parent.filter(|p| !p.exists()) {
        std::fs::create_dir_all(parent).map_err(context)?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755))
            .map_err(context)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            let deadline = tokio::time::Instant::now() + wait;
            let mut live = false;
            while UnixStream::connect(path).await.is_ok() {
                live = true;
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep(TAKEOVER_POLL).await;
            }
            if live && path.exists() {
                tracing::warn!(path = %path.display(), ?wait, "taking the push socket over from an agent that still answers on it");
                eprintln!(
                    "gpumem: warning: another agent still answers on {} after {wait:?}; taking the socket over",
                    path.display()
                );
            }
            match std::fs::remove_file(path) {
                Ok(()) => {}
                // The other agent removed it on its way out.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(context(e)),
            }
        }
        Ok(_) => {
            return Err(context(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            )));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(context)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(context)?;
    if let Some(parent) = parent {
        warn_if_open(parent, path);
    }
    tracing::info!(path = %path.display(), "accepting pushes");
    eprintln!("gpumem: accepting pushes on unix:{}", path.display());
    Ok(listener)
}

/// Warns where the push socket's directory lets another user replace the socket
/// ([`openness`]).
fn warn_if_open(directory: &Path, socket: &Path) {
    let Some(why) = openness(directory, socket) else {
        return;
    };
    tracing::warn!(directory = %directory.display(), why, "the push socket's directory could let another user replace the socket: make it 0755, owned by the agent");
    eprintln!(
        "gpumem: warning: {} is {why}, who could replace the push socket; make it 0755, owned by the agent",
        directory.display()
    );
}

/// How the socket's directory lets another user replace the socket, if it does: others may
/// write there (and it is not sticky), or it is not the owner of the socket (the agent's).
/// `None` where either cannot be read.
fn openness(directory: &Path, socket: &Path) -> Option<&'static str> {
    use std::os::unix::fs::MetadataExt;
    let (dir, own) = (
        std::fs::metadata(directory).ok()?,
        std::fs::metadata(socket).ok()?,
    );
    let writable = dir.mode() & 0o022 != 0 && dir.mode() & 0o1000 == 0;
    match (writable, dir.uid() != own.uid()) {
        (false, false) => None,
        (true, false) => Some("writable by other users"),
        (false, true) => Some("owned by another user"),
        (true, true) => Some("owned by another user and writable by others"),
    }
}

/// The process at the other end of a Unix-socket connection, as the kernel reports it
/// (`SO_PEERCRED`, in the agent's pid namespace), with its start time and, where the kernel
/// gives one, its handle (`SO_PEERPIDFD`), both taken when it connected.
#[derive(Clone, Debug)]
pub struct UnixPeer {
    /// The peer; `None` where the kernel does not say (another pid namespace's). Its start
    /// time is `None` where nothing proves the pid was still the connecting process's when
    /// it was read.
    pub process: Option<Peer>,
    /// The connecting process's handle, where the kernel gave one.
    handle: Option<Arc<PidFd>>,
    /// Whom its connections count against: its pod, or its user on the host.
    owner: Option<Owner>,
}

impl UnixPeer {
    fn of(stream: &UnixStream) -> UnixPeer {
        let cred = stream.peer_cred().ok();
        let uid = cred.map(|cred| cred.uid());
        let pid = cred
            .and_then(|cred| cred.pid())
            .and_then(|pid| u32::try_from(pid).ok())
            .filter(|&pid| pid != 0);
        let Some(pid) = pid else {
            return UnixPeer {
                process: None,
                handle: None,
                owner: uid.map(|uid| Owner::user(uid, None)),
            };
        };
        // Shared out per pod, or per user on the host: forking gains a crowd nothing.
        let owner = match crate::telemetry::cgroup::container_of(pid) {
            Some(c) if !c.pod_uid.is_empty() => Some(Owner::pod(&c.pod_uid, Some(pid))),
            _ => uid.map(|uid| Owner::user(uid, Some(pid))),
        };
        let now = |pid| Peer {
            uid,
            ..Peer::now(pid)
        };
        match PidFd::of_peer(stream) {
            PeerHandle::Held(handle) => {
                // Read after the handle was taken: the start time is the handle's process's
                // only if that process had not exited by then.
                let mut peer = now(pid);
                if handle.exited() {
                    peer.start_time = None;
                }
                UnixPeer {
                    process: Some(peer),
                    handle: Some(Arc::new(handle)),
                    owner,
                }
            }
            // The process went before the accept: its pid may be another's already.
            PeerHandle::Gone => UnixPeer {
                process: Some(Peer {
                    pid,
                    start_time: None,
                    uid,
                }),
                handle: None,
                owner,
            },
            PeerHandle::Unsupported => UnixPeer {
                process: Some(now(pid)),
                handle: None,
                owner,
            },
        }
    }

    /// A peer known without a handle, its start time its proof (a request served without a
    /// socket, as tests do).
    pub fn without_handle(process: Option<Peer>) -> UnixPeer {
        UnixPeer {
            process,
            handle: None,
            owner: None,
        }
    }

    /// The process, as proven now: its start time is cleared once its handle says it has
    /// exited (the ingest refuses a peer without one), so a connection that outlived its
    /// process cannot speak for whoever has its pid now.
    pub fn peer(&self) -> Option<Peer> {
        let mut peer = self.process?;
        if self.handle.as_ref().is_some_and(|h| h.exited()) {
            peer.start_time = None;
        }
        Some(peer)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::openness;

    /// Issue 34, case 8: a directory others may write to (not sticky) is named; the agent's
    /// own 0755 and a sticky shared one are not.
    #[test]
    fn a_socket_directory_others_can_write_is_named() {
        let dir = std::env::temp_dir().join(format!("gpumem-openness-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let socket = dir.join("push.sock");
        std::fs::write(&socket, b"").expect("a file in it");
        let mode = |m: u32| {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(m)).expect("chmod");
            openness(&dir, &socket)
        };
        assert_eq!(mode(0o777), Some("writable by other users"));
        assert_eq!(mode(0o775), Some("writable by other users"));
        assert_eq!(
            mode(0o1777),
            None,
            "sticky: others cannot replace the socket"
        );
        assert_eq!(mode(0o755), None);
        assert_eq!(openness(&dir.join("gone"), &socket), None);
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
