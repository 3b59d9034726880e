//! Recordings that outlive the node (issue 60): agents archive what they keep in object
//! storage, with a sidecar, and the tools and another agent's view open it from there.
//! Against a real S3-compatible server: moto's (PyPI's `moto[server]`, pip-installed into a
//! virtual environment the first test makes), on loopback, path-style over plain HTTP.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::agent::{Reaper, free_port, http_get, spawn_serve_with_env, wait_for};
use crate::browser::Browser;
use crate::common::temp_dir;
use crate::recordings::{
    Length, gzip, keeping_in, listed, metric, oom_recording, push, request, upload,
};
use crate::view::raw_get;

/// moto's version: the server the tests were written against.
const MOTO: &str = "moto[server]==5.2.6";
const UPLOADED: &str = r#"gpumem_recordings_uploaded_total{result="uploaded"}"#;
const FAILED: &str = r#"gpumem_recordings_uploaded_total{result="failed"}"#;
const PENDING: &str = "gpumem_recordings_upload_pending";

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `moto_server` in a virtual environment under target/, made once (kept between runs
/// where it already runs).
fn moto_server() -> &'static Path {
    static SERVER: OnceLock<PathBuf> = OnceLock::new();
    SERVER.get_or_init(|| {
        let venv = manifest().join("target/s3-venv");
        let server = venv.join("bin/moto_server");
        let works = |server: &Path| {
            Command::new(server)
                .arg("--help")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !works(&server) {
            let _ = std::fs::remove_dir_all(&venv);
            let made = Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .status()
                .expect("python3 runs");
            assert!(made.success(), "python3 -m venv");
            let out = Command::new(venv.join("bin/python"))
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    MOTO,
                ])
                .env_remove("PYTHONPATH")
                .output()
                .expect("pip runs");
            assert!(
                out.status.success(),
                "pip install {MOTO}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(works(&server), "{} runs", server.display());
        server
    })
}

/// A running S3-compatible server on a loopback port.
struct S3 {
    _server: Reaper,
    port: u16,
}

impl S3 {
    /// moto's server on `port`, its log in `dir`, answering.
    fn start(port: u16, dir: &Path) -> S3 {
        let log = dir.join(format!("moto-{port}.log"));
        let server = Reaper(
            Command::new(moto_server())
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log"))
                .spawn()
                .expect("moto_server starts"),
        );
        if wait_for(Duration::from_secs(30), || http_get(port, "/")).is_none() {
            panic!(
                "moto_server does not answer: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        S3 {
            _server: server,
            port,
        }
    }

    /// Creates bucket `name`.
    fn bucket(&self, name: &str) {
        let (status, answer) = request(
            self.port,
            "PUT",
            &format!("/{name}"),
            "application/xml",
            b"",
            Length::Own,
        );
        assert_eq!(status, 200, "bucket {name}: {answer}");
    }
}

/// The environment of a process using the store on `port` (an agent from a Secret's
/// variables, the command line from its user's).
fn s3_env(port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
        ("AWS_ACCESS_KEY_ID", "testing".into()),
        ("AWS_SECRET_ACCESS_KEY", "testing".into()),
        ("AWS_REGION", "us-east-1".into()),
        // No profile of the developer's: only what the test says.
        ("AWS_CONFIG_FILE", "/nonexistent".into()),
        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent".into()),
    ]
}

/// `gpumem serve` keeping recordings in `dir/<node>` and archiving them at `url` (the store
/// on `s3_port`) as node `node` of cluster `test`, with `extra` flags.
fn archiving_agent(
    port: u16,
    dir: &Path,
    node: &str,
    url: &str,
    s3_port: u16,
    extra: &[&str],
) -> Reaper {
    let spool = dir.join(node);
    let mut args = keeping_in(&spool);
    args.extend::<[&std::ffi::OsStr; 6]>([
        "--recordings-url".as_ref(),
        url.as_ref(),
        "--cluster".as_ref(),
        "test".as_ref(),
        "--node-name".as_ref(),
        node.as_ref(),
    ]);
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let log = dir.join(format!("serve-{node}-{port}.log"));
    spawn_serve_with_env(port, &log, None, &args, &s3_env(s3_port))
}

/// `gpumem` with `args`, using the store on `s3_port`.
fn gpumem(args: &[&str], s3_port: u16) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .envs(s3_env(s3_port))
        .stdin(Stdio::null())
        .output()
        .expect("gpumem runs")
}

fn succeeded(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `gpumem recordings list` with `args` and `--json`, using the store on `s3_port`: its
/// answer.
fn listing(args: &[&str], s3_port: u16) -> serde_json::Value {
    let command: Vec<&str> = ["recordings", "list"]
        .iter()
        .chain(args)
        .chain(&["--json"])
        .copied()
        .collect();
    let out = succeeded(gpumem(&command, s3_port), "recordings list");
    serde_json::from_str(&out).expect("JSON")
}

/// Waits until the agent on `port` shows `series` at `value` or more.
fn wait_until(port: u16, series: &str, value: f64, limit: Duration) {
    let reached = wait_for(limit, || (metric(port, series) >= value).then_some(()));
    assert!(
        reached.is_some(),
        "{series} stayed at {} (wanted {value})",
        metric(port, series)
    );
}

/// Sends SIGTERM to `agent` and waits at most `limit` for it to exit: its status.
fn terminate(agent: &mut Reaper, limit: Duration) -> std::process::ExitStatus {
    let pid = agent.0.id().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(sent.success());
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = agent.0.try_wait().expect("waits") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not exit within {limit:?} of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn recordings_are_archived_with_a_sidecar_listed_and_opened_by_the_tools_and_another_agent() {
    let dir = temp_dir("archive-open");
    let s3 = S3::start(free_port(), &dir);
    s3.bucket("ooms");
    // A prefix per namespace: the loopback job is in no pod, so under `_host`.
    let url = "s3://ooms/gpumem/{namespace}";
    let a = free_port();
    let _agent_a = archiving_agent(a, &dir, "node-a", url, s3.port, &[]);
    let (json, oom) = oom_recording();
    let recording = gzip(&json);
    push(a, 4242);
    let (status, stored) = upload(a, 4242, &recording);
    assert_eq!(status, 201, "{stored}");
    wait_until(a, UPLOADED, 1.0, Duration::from_secs(30));
    assert_eq!(metric(a, PENDING), 0.0);
    assert_eq!(metric(a, FAILED), 0.0);

    // The spool keeps it, and says where it went.
    let kept = listed(a);
    let address = kept[0]["archived"].as_str().expect("archived").to_string();
    let prefix = "s3://ooms/gpumem/_host/test/_host/node-a/";
    assert!(
        address.starts_with(prefix) && address.ends_with("-4242.pickle.gz"),
        "{address}"
    );
    let id = stored["id"].as_str().expect("an id");
    assert!(dir.join("node-a").join(format!("{id}.pickle.gz")).exists());

    // Listed from the sidecars (a prefix per namespace needs one named).
    let refused = gpumem(&["recordings", "list", url], s3.port);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--namespace"));
    let listing = listing(&[url, "--namespace", "_host"], s3.port);
    assert_eq!(listing["matched"], 1, "{listing}");
    assert_eq!(listing["truncated"], false);
    let sidecar = &listing["recordings"][0];
    assert_eq!(sidecar["format"], 1);
    assert_eq!(sidecar["recording"], address.as_str());
    assert_eq!(
        (
            &sidecar["cluster"],
            &sidecar["node"],
            &sidecar["namespace"],
            &sidecar["pod"]
        ),
        (
            &serde_json::json!("test"),
            &serde_json::json!("node-a"),
            &serde_json::json!("_host"),
            &serde_json::json!("node-a")
        )
    );
    assert_eq!(sidecar["pid"], 4242);
    assert_eq!(sidecar["bytes"], recording.len());
    assert_eq!(
        (&sidecar["device"], &sidecar["oom_event"]),
        (&serde_json::json!(0), &serde_json::json!(oom))
    );
    let parsed = gpumem::recording::parse_recording(&json).expect("reads");
    let oom_entry = parsed.device_traces[0][oom];
    assert_eq!(sidecar["oom"]["requested_bytes"], oom_entry.size);
    assert_eq!(sidecar["oom"]["device_free_bytes"], oom_entry.addr);
    let reserved: u64 = parsed.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(sidecar["oom"]["reserved_bytes"], reserved);
    let text = succeeded(
        gpumem(
            &[
                "recordings",
                "list",
                url,
                "--namespace",
                "_host",
                "--pod",
                "node-b",
            ],
            s3.port,
        ),
        "recordings list --pod",
    );
    assert!(text.contains("no recording"), "another pod's: {text}");

    // The tools open it from the store, as they open the file it came from.
    let local = dir.join("local.pickle.gz");
    std::fs::write(&local, &recording).expect("writes");
    let from_file = succeeded(
        gpumem(
            &["explain", "--json", local.to_str().expect("UTF-8")],
            s3.port,
        ),
        "explain a file",
    );
    for archived in [address.clone(), address.replace(".pickle.gz", ".json")] {
        let from_store = succeeded(
            gpumem(&["explain", "--json", &archived], s3.port),
            "explain",
        );
        assert_eq!(from_store, from_file, "{archived}");
    }
    let replayed = succeeded(
        gpumem(&["replay", "--check", &address], s3.port),
        "replay --check",
    );
    assert!(
        replayed.contains("events match the recording"),
        "{replayed}"
    );
    let missing = gpumem(
        &[
            "explain",
            &format!("{prefix}20990101T000000.000000Z-1.pickle.gz"),
        ],
        s3.port,
    );
    assert!(!missing.status.success());
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no such object"),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );

    // Another agent of the cluster, which never saw the job, opens it by namespace and pod.
    let b = free_port();
    let _agent_b = archiving_agent(b, &dir, "node-b", url, s3.port, &[]);
    let (status, head, _) =
        raw_get(b, "/recordings/archive/_host/node-a", "127.0.0.1", None).expect("answers");
    assert_eq!(status, 303, "{head}");
    let name = address
        .rsplit('/')
        .next()
        .and_then(|f| f.strip_suffix(".pickle.gz"))
        .expect("a name");
    let location = format!("location: node-a/{name}/#device=0&event={oom}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&location.to_ascii_lowercase()),
        "{head}"
    );
    let page = format!("/recordings/archive/_host/node-a/{name}/");
    let (status, _, html) = raw_get(b, &page, "127.0.0.1", None).expect("answers");
    assert_eq!(status, 200);
    assert!(html.contains("<html"), "{html}");
    let (status, _, overview) =
        raw_get(b, &format!("{page}api/v1/recording"), "127.0.0.1", None).expect("answers");
    assert_eq!(status, 200, "{overview}");
    let overview: serde_json::Value = serde_json::from_str(&overview).expect("JSON");
    assert!(
        overview
            .to_string()
            .contains(&format!("node-a ({name}, archived)")),
        "{overview}"
    );
    // The other agent's page, in a browser: opened at the OOM, explained as from the file.
    let from_file: serde_json::Value = serde_json::from_str(&from_file).expect("JSON");
    shown_in_a_browser(b, oom, &from_file["sentence"]);
    // `gpumem view` on the address, as on a file.
    let view_port = free_port();
    let _view = Reaper(
        Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args([
                "view",
                &address,
                "--listen",
                &format!("127.0.0.1:{view_port}"),
            ])
            .envs(s3_env(s3.port))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("gpumem view starts"),
    );
    let overview = wait_for(Duration::from_secs(30), || {
        http_get(view_port, "/api/v1/recording")
    })
    .expect("gpumem view serves the archived recording");
    let overview: serde_json::Value = serde_json::from_str(&overview).expect("JSON");
    assert_eq!(
        overview["devices"][0]["ooms"],
        serde_json::json!([oom]),
        "{overview}"
    );
    assert!(
        overview.to_string().contains(&address),
        "named by its address: {overview}"
    );
    // A laptop's AWS CLI profile: keys and endpoint from its files, none in the environment.
    let aws = dir.join("aws");
    std::fs::create_dir_all(&aws).expect("a directory");
    std::fs::write(
        aws.join("credentials"),
        "[oncall]\naws_access_key_id = testing\naws_secret_access_key = testing\n",
    )
    .expect("writes");
    std::fs::write(
        aws.join("config"),
        format!(
            "[profile oncall]\nregion = us-east-1\nendpoint_url = http://127.0.0.1:{}\n",
            s3.port
        ),
    )
    .expect("writes");
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["recordings", "list", url, "--namespace", "_host"])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("AWS_REGION")
        .env("AWS_PROFILE", "oncall")
        .env("AWS_SHARED_CREDENTIALS_FILE", aws.join("credentials"))
        .env("AWS_CONFIG_FILE", aws.join("config"))
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .output()
        .expect("runs");
    let text = succeeded(out, "recordings list with a profile");
    assert!(
        text.contains(&address) && text.contains("test/_host/node-a") && text.contains("pid 4242"),
        "{text}"
    );
    // Behind the page's credentials, as the kept recordings are.
    let c = free_port();
    std::fs::write(dir.join("tokens"), "t0ken-of-the-oncall-team\n").expect("writes");
    std::fs::write(dir.join("web.yml"), "bearer_auth_tokens_file: tokens\n").expect("writes");
    let web = dir.join("web.yml");
    let _agent_c = archiving_agent(
        c,
        &dir,
        "node-c",
        url,
        s3.port,
        &["--web-config-file", web.to_str().expect("UTF-8")],
    );
    let newest = "/recordings/archive/_host/node-a";
    assert_eq!(get_with_token(c, newest, None), 401);
    assert_eq!(get_with_token(c, newest, Some("wrong")), 401);
    assert_eq!(
        get_with_token(c, newest, Some("t0ken-of-the-oncall-team")),
        303
    );
    for (path, wanted) in [
        ("/recordings/archive/_host/nobody".to_string(), 404),
        (
            "/recordings/archive/_host/node-a/20990101T000000.000000Z-1/api/v1/recording".into(),
            404,
        ),
        (
            "/recordings/archive/_host/node-a/..%2F..%2Fx/api/v1/recording".into(),
            404,
        ),
        ("/recordings/archive/other/node-a".into(), 404),
    ] {
        let (status, _, body) = raw_get(b, &path, "127.0.0.1", None).expect("answers");
        assert_eq!(status, wanted, "{path}: {body}");
    }
}

/// The status of a GET of `path` on `port`, with `token` as a bearer token where given.
fn get_with_token(port: u16, path: &str, token: Option<&str>) -> u16 {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connects");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n"
    )
    .expect("writes");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Opens the pod's newest archived recording on the agent on `port` in Chromium, as the OOM
/// alert's link would: it must show event `oom` explained by `sentence`, without errors.
fn shown_in_a_browser(port: u16, oom: usize, sentence: &serde_json::Value) {
    let browser = Browser::start();
    browser.open(&format!(
        "http://127.0.0.1:{port}/recordings/archive/_host/node-a"
    ));
    let shown = crate::view::shown_explanation(&browser);
    assert_eq!(&shown["sentence"], sentence, "{shown}");
    assert_eq!(
        shown["event"],
        oom.to_string(),
        "opened at the OOM: {shown}"
    );
    assert_eq!(shown["shown_error"], "", "{shown}");
    assert!(
        shown["url"]
            .as_str()
            .is_some_and(|u| u.contains("/recordings/archive/_host/node-a/")),
        "{shown}"
    );
    assert_eq!(browser.console_errors(), Vec::<String>::new());
    browser.screenshot("archived-recording.png");
}

/// A TLS front of the plain-HTTP server on `target`, its certificate (for localhost and
/// 127.0.0.1) signed by a CA of its own: its port and the CA's file. Its thread serves for
/// at most two minutes.
fn tls_front(target: u16, dir: &Path) -> (u16, PathBuf) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (ca, cert, key) = crate::web_config::certificates_named(dir, "store");
    let chain = CertificateDer::pem_file_iter(&cert)
        .expect("reads")
        .collect::<Result<Vec<_>, _>>()
        .expect("PEM");
    let key = PrivateKeyDer::from_pem_file(&key).expect("a key");
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("a server configuration");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("an address").port();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime.block_on(async move {
            let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
            let listener = tokio::net::TcpListener::from_std(listener).expect("a listener");
            let serve = async {
                while let Ok((tcp, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let Ok(mut tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let Ok(mut plain) =
                            tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    });
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(120), serve).await;
        });
    });
    (port, ca)
}

#[test]
fn a_store_behind_a_private_ca_is_reached_over_tls_once_its_ca_is_trusted() {
    let dir = temp_dir("archive-tls");
    let s3 = S3::start(free_port(), &dir);
    s3.bucket("ooms");
    let (port, ca) = tls_front(s3.port, &dir);
    let https = |trusted: bool| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpumem"));
        command
            .args(["recordings", "list", "s3://ooms/p"])
            .envs(s3_env(s3.port))
            .env("AWS_ENDPOINT_URL", format!("https://localhost:{port}"))
            .env_remove("SSL_CERT_DIR")
            .stdin(Stdio::null());
        if trusted {
            command.env("SSL_CERT_FILE", &ca);
        } else {
            command.env("SSL_CERT_FILE", "/nonexistent");
        }
        command.output().expect("runs")
    };
    // Mozilla's roots and the system's do not include the store's CA: refused.
    let refused = https(false);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "an unknown CA is trusted");
    assert!(said.to_ascii_lowercase().contains("certificate"), "{said}");
    // Its CA named: the listing goes through (an empty archive).
    let listed = succeeded(https(true), "recordings list over TLS");
    assert!(
        listed.contains("no recording in s3://ooms/p matches"),
        "{listed}"
    );
}

#[test]
fn a_store_that_is_down_keeps_the_spool_counts_and_tries_again() {
    let dir = temp_dir("archive-down");
    let s3_port = free_port();
    let a = free_port();
    let _agent = archiving_agent(a, &dir, "node-a", "s3://ooms/p", s3_port, &[]);
    let (json, _) = oom_recording();
    push(a, 7);
    let (status, stored) = upload(a, 7, &gzip(&json));
    assert_eq!(status, 201, "{stored}");
    wait_until(a, FAILED, 1.0, Duration::from_secs(20));
    assert_eq!(metric(a, PENDING), 1.0);
    assert_eq!(metric(a, UPLOADED), 0.0);
    assert_eq!(listed(a)[0].get("archived"), None, "not archived yet");
    let id = stored["id"].as_str().expect("an id");
    let spooled = dir.join("node-a").join(format!("{id}.pickle.gz"));
    assert!(spooled.exists(), "kept in the spool");

    // The store comes up: the next try archives it, and the spool keeps its copy.
    let s3 = S3::start(s3_port, &dir);
    s3.bucket("ooms");
    wait_until(a, UPLOADED, 1.0, Duration::from_secs(60));
    assert_eq!(metric(a, PENDING), 0.0);
    assert!(spooled.exists());
    let listing = listing(&["s3://ooms/p"], s3.port);
    assert_eq!(listing["matched"], 1, "{listing}");
    assert_eq!(listing["recordings"][0]["pid"], 7);
}

#[test]
fn sigterm_with_uploads_pending_archives_within_the_grace_or_leaves_them_spooled() {
    let dir = temp_dir("archive-sigterm");
    let s3_port = free_port();
    let url = "s3://ooms/p";
    let (json, _) = oom_recording();
    let recording = gzip(&json);

    // The store is down: SIGTERM ends the agent within its grace, the recording spooled.
    let a = free_port();
    let mut agent = archiving_agent(
        a,
        &dir,
        "node-a",
        url,
        s3_port,
        &["--recordings-upload-grace", "3"],
    );
    push(a, 11);
    assert_eq!(upload(a, 11, &recording).0, 201);
    wait_until(a, FAILED, 1.0, Duration::from_secs(20));
    let status = terminate(&mut agent, Duration::from_secs(15));
    assert!(status.success(), "{status}");
    let meta: Vec<serde_json::Value> = std::fs::read_dir(dir.join("node-a"))
        .expect("the spool")
        .filter_map(|e| {
            let path = e.ok()?.path();
            (path.extension()? == "json").then(|| {
                serde_json::from_slice(&std::fs::read(&path).expect("reads")).expect("JSON")
            })
        })
        .collect();
    assert_eq!(meta.len(), 1, "spooled: {meta:?}");
    assert_eq!(meta[0].get("archived"), None);

    // The store is up again; a new agent on the same spool archives what the last one left.
    let s3 = S3::start(s3_port, &dir);
    s3.bucket("ooms");
    let a = free_port();
    let mut agent = archiving_agent(
        a,
        &dir,
        "node-a",
        url,
        s3_port,
        &["--recordings-upload-grace", "20"],
    );
    wait_until(a, UPLOADED, 1.0, Duration::from_secs(30));

    let status = terminate(&mut agent, Duration::from_secs(25));
    assert!(status.success(), "{status}");

    // A recording still pending at SIGTERM is archived before the agent exits: the store is
    // cut off (connections closed at once) until the agent is told to stop, then restored.
    let gate = Gate::open_to(s3_port);
    let a = free_port();
    let log = dir.join(format!("serve-node-c-{a}.log"));
    let mut agent = archiving_agent(
        a,
        &dir,
        "node-c",
        url,
        gate.port,
        &["--recordings-upload-grace", "20"],
    );
    push(a, 12);
    assert_eq!(upload(a, 12, &recording).0, 201);
    // Three failures: the next try is 4 s away.
    wait_until(a, FAILED, 3.0, Duration::from_secs(20));
    assert_eq!(metric(a, PENDING), 1.0);
    gate.pass();
    let status = terminate(&mut agent, Duration::from_secs(25));
    assert!(status.success(), "{status}");
    let said = std::fs::read_to_string(&log).expect("the log");
    assert!(
        said.contains("archiving the recordings left before stopping") && said.contains("left=1"),
        "archived while stopping: {said}"
    );
    let listing = listing(&[url], s3.port);
    assert_eq!(listing["matched"], 2, "{listing}");
    let pids: Vec<_> = (0..2)
        .map(|i| listing["recordings"][i]["pid"].clone())
        .collect();
    assert!(pids.contains(&serde_json::json!(12)), "{pids:?}");
}

/// A loopback TCP forwarder to a port that closes every connection at once until told to
/// [`Gate::pass`]; its threads end with the test process (each copy ends with its
/// connection, the accept loop within two minutes).
struct Gate {
    port: u16,
    passing: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Gate {
    fn open_to(target: u16) -> Gate {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("an address").port();
        let passing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = std::sync::Arc::clone(&passing);
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(120);
            while Instant::now() < deadline {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if !open.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let _ = client.set_nonblocking(false);
                for (mut from, mut to) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ]
                .into_iter()
                .filter_map(|(f, t)| Some((f.ok()?, t.ok()?)))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Gate { port, passing }
    }

    /// Lets connections through from now on.
    fn pass(&self) {
        self.passing
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
