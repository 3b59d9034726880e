//! A real browser for the tests of gpumem's pages: headless Chromium driven by ChromeDriver
//! over the W3C WebDriver protocol (plain HTTP and JSON on loopback), no client library.
//!
//! `scripts/test-all` installs Debian's `chromium` and `chromium-driver` where they are
//! missing; a test that needs the browser fails, naming them, when they are not there.
//! Every wait is bounded; the driver (and with it the browser) is killed when the
//! [`Browser`] is dropped, however the test ends.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

use crate::agent::{Reaper, free_port, wait_for};

/// One headless Chromium session.
pub(crate) struct Browser {
    port: u16,
    session: String,
    profile: PathBuf,
    _driver: Reaper,
}

/// Where the tests leave their screenshots: `target/tmp/screenshots/`.
pub(crate) fn screenshot_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot directory");
    dir
}

impl Browser {
    /// Starts ChromeDriver on a free loopback port and opens a headless Chromium session
    /// that records the page's console.
    pub(crate) fn start() -> Browser {
        let port = free_port();
        let driver = Reaper(
            Command::new("chromedriver")
                .arg(format!("--port={port}"))
                .arg("--allowed-ips=127.0.0.1")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect(
                    "chromedriver is installed (scripts/test-all installs Debian's chromium and chromium-driver)",
                ),
        );
        wait_for(Duration::from_secs(20), || {
            request(port, "GET", "/status", None)
                .ok()
                .filter(|v| v["value"]["ready"] == true)
        })
        .expect("chromedriver answers /status within 20 s");
        let profile =
            std::env::temp_dir().join(format!("gpumem-chromium-{}-{port}", std::process::id()));
        let capabilities = json!({
            "capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": "/usr/bin/chromium",
                    "args": [
                        "--headless=new", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", "--window-size=1280,1600",
                        "--no-first-run", "--disable-extensions",
                        format!("--user-data-dir={}", profile.display()),
                    ],
                },
                "goog:loggingPrefs": {"browser": "ALL"},
                "timeouts": {"pageLoad": 30000, "script": 30000},
            }}
        });
        let answer = request(port, "POST", "/session", Some(&capabilities))
            .unwrap_or_else(|e| panic!("a Chromium session: {e}"));
        let session = answer["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a session id in {answer}"))
            .to_string();
        Browser {
            port,
            session,
            profile,
            _driver: driver,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let answer =
            request(self.port, method, &path, body).unwrap_or_else(|e| panic!("{path}: {e}"));
        answer["value"].clone()
    }

    /// Loads `url` and waits (WebDriver's page-load strategy) until it has loaded.
    pub(crate) fn open(&self, url: &str) {
        self.call("POST", "/url", Some(&json!({ "url": url })));
    }

    /// Runs `script` (a function body; `return` gives the value) in the page.
    pub(crate) fn eval(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(&json!({ "script": script, "args": [] })),
        )
    }

    /// The console's errors (and failed loads) since the last call.
    pub(crate) fn console_errors(&self) -> Vec<String> {
        let entries = self.call("POST", "/se/log", Some(&json!({ "type": "browser" })));
        entries
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["level"] == "SEVERE")
            .map(|e| e["message"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Writes a PNG of the viewport to `screenshot_dir()/name`, and returns its path.
    pub(crate) fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.call("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 PNG"))
            .expect("valid base64");
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
        let path = screenshot_dir().join(name);
        std::fs::write(&path, bytes).expect("write screenshot");
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = request(
            self.port,
            "DELETE",
            &format!("/session/{}", self.session),
            None,
        );
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// One read, again when a signal interrupted it (a raw `read` may return `Interrupted`).
fn read_some(stream: &mut TcpStream, buf: &mut [u8]) -> Result<usize, String> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other.map_err(|e| e.to_string()),
        }
    }
}

/// One WebDriver command: an HTTP/1.1 request on loopback (one connection each), its JSON
/// answer; an error answer (`value.error`) becomes `Err`.
fn request(port: u16, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    // ChromeDriver keeps the connection open whatever the request says: read the head, then
    // the body by its length (or its chunks).
    let mut response = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let split = loop {
        if let Some(at) = response.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        let n = read_some(&mut stream, &mut buf)?;
        if n == 0 {
            return Err("the connection closed before the HTTP head ended".into());
        }
        response.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&response[..split]).to_ascii_lowercase();
    let mut payload = response[split + 4..].to_vec();
    let length = head.lines().find_map(|l| {
        l.strip_prefix("content-length:")
            .and_then(|v| v.trim().parse::<usize>().ok())
    });
    let chunked = head.contains("transfer-encoding: chunked");
    loop {
        let complete = match length {
            Some(len) => payload.len() >= len,
            None if chunked => payload.ends_with(b"0\r\n\r\n"),
            None => false,
        };
        if complete {
            break;
        }
        let n = read_some(&mut stream, &mut buf)?;
        if n == 0 {
            break;
        }
        payload.extend_from_slice(&buf[..n]);
    }
    if chunked {
        payload = dechunk(&payload)?;
    }
    let value: Value = serde_json::from_slice(&payload)
        .map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&payload)))?;
    if let Some(error) = value["value"]["error"].as_str() {
        return Err(format!("{error}: {}", value["value"]["message"]));
    }
    Ok(value)
}

/// Undoes HTTP/1.1 chunked transfer coding.
fn dechunk(mut data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk size line")?;
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&data[..line])
                .split(';')
                .next()
                .unwrap_or_default()
                .trim(),
            16,
        )
        .map_err(|e| e.to_string())?;
        data = &data[line + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = data.get(..size).ok_or("a truncated chunk")?;
        out.extend_from_slice(chunk);
        data = data.get(size + 2..).ok_or("a chunk's line end")?;
    }
}
