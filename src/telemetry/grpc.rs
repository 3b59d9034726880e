//! Unary gRPC calls to a node daemon over its Unix socket (the kubelet's pod-resources API,
//! the container runtime's CRI), with prost messages declared by hand beside each client.
//!
//! # Invariants
//! - Every call is bounded by its timeout, connecting included; answers by tonic's 4 MiB
//!   decoder limit.
//! - A failure is a [`GrpcError`] naming the socket or the method and the cause, never a panic.

use std::path::Path;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Why a daemon gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    /// No socket, a refused connection, or a timeout while connecting.
    #[error("cannot connect to {socket}: {reason}")]
    Connect {
        /// The socket asked.
        socket: String,
        /// The transport error and its causes.
        reason: String,
    },
    /// The connection never became ready.
    #[error("the daemon is not ready: {0}")]
    NotReady(String),
    /// A gRPC status other than OK (a timeout included).
    #[error("{method} failed: {code}: {message}")]
    Status {
        /// The method called.
        method: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The daemon's message.
        message: String,
    },
}

/// A connection to the daemon on `socket`, each call on it bounded by `timeout`.
///
/// # Errors
/// [`GrpcError::Connect`] when the socket does not answer within `timeout`.
pub async fn connect(socket: &Path, timeout: Duration) -> Result<Channel, GrpcError> {
    let path = socket.to_path_buf();
    // The URI is required by the API and unused: every connection goes to the socket.
    Endpoint::from_static("http://localhost")
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|e| GrpcError::Connect {
            socket: socket.display().to_string(),
            reason: source_chain(&e),
        })
}

/// Calls `method` (its full path, `/package.Service/Method`) with `request`.
///
/// # Errors
/// [`GrpcError::NotReady`] or [`GrpcError::Status`].
pub async fn unary<Q, A>(channel: Channel, method: &'static str, request: Q) -> Result<A, GrpcError>
where
    Q: prost::Message + Send + Sync + 'static,
    A: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| GrpcError::NotReady(source_chain(&e)))?;
    let answer = grpc
        .unary(
            tonic::Request::new(request),
            tonic::codegen::http::uri::PathAndQuery::from_static(method),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .map_err(|status| GrpcError::Status {
            method,
            code: status.code(),
            message: status.message().to_string(),
        })?;
    Ok(answer.into_inner())
}

/// An error and its causes on one line (tonic's transport errors hide the useful part).
fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}
