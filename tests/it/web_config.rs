//! The agent behind TLS and basic authentication (issue 36), configured by a web configuration
//! file in the Prometheus exporter-toolkit's format: scrapes with and without credentials over
//! TLS, pushes needing none (on the TLS listener and on a plain push-only one), and a real
//! Prometheus scraping over TLS with a CA file and basic authentication. Loopback only.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};

use crate::agent::{Reaper, free_port, prometheus_query, spawn_prometheus_configured, wait_for};
use crate::common::temp_dir;

/// A CA (`<name>-ca.crt`) and a certificate it signed for 127.0.0.1 and localhost
/// (`<name>.crt`, `<name>.key`), in `dir`: (CA file, cert file, key file).
pub(crate) fn certificates_named(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().expect("key");
    let ca_cert = ca.self_signed(&ca_key).expect("CA");
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    leaf.subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    let key = KeyPair::generate().expect("key");
    let cert = leaf.signed_by(&key, &ca_cert, &ca_key).expect("signed");
    let paths = (
        dir.join(format!("{name}-ca.crt")),
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    std::fs::write(&paths.0, ca_cert.pem()).expect("ca");
    std::fs::write(&paths.1, cert.pem()).expect("cert");
    std::fs::write(&paths.2, key.serialize_pem()).expect("key");
    paths
}

/// The server's CA and certificate (`tls.crt`, `tls.key`, `ca.crt`).
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (ca, cert, key) = certificates_named(dir, "tls");
    std::fs::rename(&ca, dir.join("ca.crt")).expect("renamed");
    (dir.join("ca.crt"), cert, key)
}

/// A raw HTTP/1.1 request over TLS (trusting `ca`), with basic credentials where given: the
/// status, or `None` when no TLS response came.
fn https(
    port: u16,
    ca: &Path,
    request: &str,
    credentials: Option<(&str, &str)>,
) -> Option<(u16, String)> {
    https_as(port, ca, None, request, credentials)
}

/// As [`https`], presenting the client certificate and key `identity` where given.
fn https_as(
    port: u16,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    request: &str,
    credentials: Option<(&str, &str)>,
) -> Option<(u16, String)> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).ok()?;
    for cert in rustls_pemfile_certs(&pem) {
        roots.add(cert).ok()?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .ok()?
    .with_root_certificates(roots);
    let config = match identity {
        None => config.with_no_client_auth(),
        Some((cert, key)) => {
            use rustls::pki_types::pem::PemObject;
            let chain = rustls_pemfile_certs(&std::fs::read(cert).ok()?);
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).ok()?;
            config.with_client_auth_cert(chain, key).ok()?
        }
    };
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").ok()?;
    let mut connection = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut socket = TcpStream::connect(("127.0.0.1", port)).ok()?;
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut stream = rustls::Stream::new(&mut connection, &mut socket);
    let authorization = credentials.map_or(String::new(), |(user, password)| {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        format!("Authorization: Basic {token}\r\n")
    });
    let (head, body) = request.split_once("\r\n\r\n").unwrap_or((request, ""));
    write!(
        stream,
        "{head}\r\nHost: 127.0.0.1\r\n{authorization}Connection: close\r\n\r\n{body}"
    )
    .ok()?;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, text))
}

fn rustls_pemfile_certs(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

/// `gpumem serve` on `port` with the web configuration `config` (its log in `log`), its
/// sockets and kubelet parts off, with `extra` arguments.
fn agent(port: u16, config: &Path, log: &Path, extra: &[&str]) -> Reaper {
    Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--web-config-file")
            .arg(config)
            .args([
                "--push-socket",
                "",
                "--pod-resources-socket",
                "",
                "--kubelet-logs",
                "",
            ])
            .args(extra)
            .stderr(std::fs::File::create(log).expect("log"))
            .spawn()
            .expect("starts"),
    )
}

/// A push of process `pid`.
fn push_request(pid: u32) -> String {
    let body = serde_json::json!({
        "pid": pid, "seq": 1,
        "devices": [{"index": 0, "uuid": "GPU-1", "stats": {"reserved_bytes.all.current": 2048}}]
    })
    .to_string();
    format!(
        "POST /api/v1/push HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn tls_and_basic_authentication_guard_all_but_pushes_and_probes() {
    let dir = temp_dir("web-config");
    // The configuration names the certificate and key relative to its own directory.
    let (ca, _, _) = certificates(&dir);
    let hash = bcrypt::hash("s3cret", 4).expect("hash");
    let config = dir.join("web.yml");
    std::fs::write(
        &config,
        format!(
            "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n  min_version: TLS12\nbasic_auth_users:\n  prometheus: {hash}\n"
        ),
    )
    .expect("web config");
    let port = free_port();
    let push_port = free_port();
    let log = dir.join("agent.log");
    let _agent = agent(
        port,
        &config,
        &log,
        &["--push-listen", &format!("127.0.0.1:{push_port}")],
    );
    let ready = wait_for(Duration::from_secs(20), || {
        https(port, &ca, "GET /healthz HTTP/1.1", None).filter(|(s, _)| *s == 200)
    });
    assert!(
        ready.is_some(),
        "no TLS answer: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );

    // Without credentials, with wrong ones, for an unknown user: 401, asking for Basic.
    for credentials in [
        None,
        Some(("prometheus", "wrong")),
        Some(("nobody", "s3cret")),
    ] {
        let (status, text) =
            https(port, &ca, "GET /metrics HTTP/1.1", credentials).expect("answer");
        assert_eq!(status, 401, "{credentials:?}: {text}");
        assert!(
            text.contains("WWW-Authenticate: Basic") || text.contains("www-authenticate: Basic"),
            "{text}"
        );
    }
    let (status, text) = https(port, &ca, "GET /api/v1/node HTTP/1.1", None).expect("answer");
    assert_eq!(status, 401, "the page's API: {text}");
    // With them: the metrics, the page and its API (served: the agent asks for credentials).
    for path in ["/metrics", "/", "/api/v1/node"] {
        let (status, text) = https(
            port,
            &ca,
            &format!("GET {path} HTTP/1.1"),
            Some(("prometheus", "s3cret")),
        )
        .expect("answer");
        assert_eq!(status, 200, "{path}: {text}");
    }
    // Pushes and probes need none, over TLS and on the plain push-only listener, which
    // serves nothing else.
    let (status, text) = https(port, &ca, &push_request(4242), None).expect("answer");
    assert_eq!(status, 202, "{text}");
    let mut plain = TcpStream::connect(("127.0.0.1", push_port)).expect("push listener");
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let request = push_request(4343);
    let (head, body) = request.split_once("\r\n\r\n").expect("request");
    write!(
        plain,
        "{head}\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n{body}"
    )
    .expect("sends");
    let mut answer = String::new();
    let _ = plain.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    let mut plain = TcpStream::connect(("127.0.0.1", push_port)).expect("push listener");
    write!(
        plain,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("sends");
    let mut answer = String::new();
    let _ = plain.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 404"),
        "the push listener serves pushes only: {answer}"
    );
    // Plain HTTP to the TLS listener gets no HTTP answer.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = write!(plain, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&answer)
    );

    // A real Prometheus scrapes it over TLS, trusting the CA, with basic authentication.
    std::fs::write(dir.join("password"), "s3cret").expect("password");
    let (_prometheus, prom_port) = spawn_prometheus_configured(
        &dir,
        &format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: gpumem\n    scheme: https\n    tls_config:\n      ca_file: {}\n    basic_auth:\n      username: prometheus\n      password_file: {}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n",
            ca.display(),
            dir.join("password").display()
        ),
    );
    let pushed = wait_for(Duration::from_secs(30), || {
        let r = prometheus_query(prom_port, "gpumem_allocator_reserved_bytes{pid=\"4242\"}")?;
        (!r.as_array()?.is_empty()).then_some(r)
    });
    assert!(
        pushed.is_some(),
        "Prometheus did not scrape the pushed series over TLS"
    );
    let up = prometheus_query(prom_port, "up{job=\"gpumem\"}").expect("query");
    assert_eq!(up[0]["value"][1], "1", "{up}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With client certificates required, a client without one, or with one another CA signed,
/// gets no answer; one with a certificate the configured CA signed is served.
#[test]
fn required_client_certificates_are_verified_against_the_ca() {
    let dir = temp_dir("web-config-mtls");
    let (ca, _, _) = certificates(&dir);
    let (client_ca, client_cert, client_key) = certificates_named(&dir, "client");
    let (_, stranger_cert, stranger_key) = certificates_named(&dir, "stranger");
    let config = dir.join("web.yml");
    std::fs::write(
        &config,
        format!(
            "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {}\n",
            client_ca.display()
        ),
    )
    .expect("web config");
    let port = free_port();
    let log = dir.join("agent.log");
    let _agent = agent(port, &config, &log, &[]);
    let identity = Some((client_cert.as_path(), client_key.as_path()));
    let served = wait_for(Duration::from_secs(20), || {
        https_as(port, &ca, identity, "GET /metrics HTTP/1.1", None).filter(|(s, _)| *s == 200)
    });
    assert!(
        served.is_some(),
        "no answer with the CA's client certificate: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(
        https_as(port, &ca, None, "GET /metrics HTTP/1.1", None),
        None,
        "without a client certificate"
    );
    let stranger = Some((stranger_cert.as_path(), stranger_key.as_path()));
    assert_eq!(
        https_as(port, &ca, stranger, "GET /metrics HTTP/1.1", None),
        None,
        "with another CA's client certificate"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
