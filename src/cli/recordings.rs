//! `gpumem recordings list URL`: the recordings the agents archived (`archive`), newest
//! first, from their sidecars.

use std::process::ExitCode;

use gpumem::archive::address::{RecordingKey, valid_segment};
use gpumem::archive::{Archive, ArchiveUrl, Credentials, MAX_LISTED, Sidecar};

use super::{CliResult, outln};

#[derive(clap::Subcommand)]
pub(crate) enum Command {
    /// List the recordings in an archive, newest first: when, whose, the OOM, and the
    /// address to open with `gpumem view`, `explain`, `replay` or `plan`.
    List(ListArgs),
}

#[derive(clap::Args)]
pub(crate) struct ListArgs {
    /// The archive, as the agents were given it (--recordings-url; a {namespace} segment
    /// needs --namespace).
    url: ArchiveUrl,
    /// Only this namespace's recordings (`_host`: processes in no known pod).
    #[arg(long, value_parser = segment)]
    namespace: Option<String>,
    /// Only this cluster's.
    #[arg(long, value_parser = segment)]
    cluster: Option<String>,
    /// Only this pod's.
    #[arg(long, value_parser = segment)]
    pod: Option<String>,
    /// The most recordings listed (their sidecars are read).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
    limit: u32,
    /// JSON: {"recordings": [sidecar, …], "matched": N, "truncated": bool, "skipped": N,
    /// "unreadable": [{"sidecar": address, "error": text}, …]}.
    #[arg(long)]
    json: bool,
}

fn segment(text: &str) -> Result<String, String> {
    if valid_segment(text) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a name (letters, digits, '-', '_' and '.')"
        ))
    }
}

pub(crate) fn run(command: Command) -> CliResult {
    match command {
        Command::List(args) => list(args),
    }
}

fn list(args: ListArgs) -> CliResult {
    if args.url.per_namespace() && args.namespace.is_none() {
        return Err(format!(
            "{}: the archive has a prefix per namespace: name one with --namespace",
            args.url
        )
        .into());
    }
    let namespace = args.namespace.as_deref().unwrap_or_default();
    let prefix = args.url.prefix(namespace);
    // The narrowest directory the filters name.
    let dir = match (&args.cluster, &args.namespace, &args.pod) {
        (Some(c), Some(n), Some(p)) => RecordingKey::pod_dir(&prefix, c, n, p),
        (Some(c), Some(n), None) => prefix.clone().join(c.as_str()).join(n.as_str()),
        (Some(c), ..) => prefix.clone().join(c.as_str()),
        _ => prefix.clone(),
    };
    let archive = Archive::open(args.url.clone(), Credentials::WithProfiles)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listed = runtime.block_on(async {
        let keep = |key: &RecordingKey| {
            args.cluster.as_ref().is_none_or(|c| *c == key.cluster)
                && args.namespace.as_ref().is_none_or(|n| *n == key.namespace)
                && args.pod.as_ref().is_none_or(|p| *p == key.pod)
        };
        let mut keys: Vec<RecordingKey> = Vec::new();
        let listed = archive
            .for_each(&dir, |object| {
                if let Some((key, true)) = RecordingKey::of(&prefix, &object.location)
                    && keep(&key)
                {
                    keys.push(key);
                }
            })
            .await?;
        // Newest first: a name starts with its time.
        keys.sort_by(|a, b| b.name.cmp(&a.name).then_with(|| a.cmp(b)));
        let matched = keys.len();
        let mut sidecars = Vec::new();
        let mut unreadable = Vec::new();
        for key in keys.iter().take(args.limit as usize) {
            match archive.sidecar(&prefix, key).await {
                // Whose it is, as its key says: a sidecar's own words are not trusted.
                Ok(sidecar) => sidecars.push(Sidecar {
                    recording: archive.url().object_url(&key.recording(&prefix)),
                    cluster: key.cluster.clone(),
                    namespace: key.namespace.clone(),
                    pod: key.pod.clone(),
                    ..sidecar
                }),
                Err(e) => unreadable.push(serde_json::json!({
                    "sidecar": archive.url().object_url(&key.sidecar(&prefix)),
                    "error": e.to_string(),
                })),
            }
        }
        Ok::<_, gpumem::archive::ArchiveError>((sidecars, matched, listed, unreadable))
    });
    let (sidecars, matched, listed, unreadable) = listed?;
    if args.json {
        let json = serde_json::json!({
            "recordings": sidecars,
            "matched": matched,
            "truncated": listed.truncated,
            "skipped": listed.skipped,
            "unreadable": unreadable,
        });
        outln!("{json}")?;
        return Ok(ExitCode::SUCCESS);
    }
    if sidecars.is_empty() && unreadable.is_empty() {
        outln!("no recording in {} matches", args.url)?;
    }
    for sidecar in &sidecars {
        outln!("{}", line(sidecar))?;
    }
    for problem in &unreadable {
        outln!("unreadable: {} ({})", problem["sidecar"], problem["error"])?;
    }
    if matched > sidecars.len() + unreadable.len() {
        outln!(
            "{} of {matched} shown (--limit)",
            sidecars.len() + unreadable.len()
        )?;
    }
    if listed.skipped > 0 {
        outln!(
            "{} objects skipped: their keys are not paths an agent writes",
            listed.skipped
        )?;
    }
    if listed.truncated {
        outln!(
            "the listing stopped at {MAX_LISTED} objects: narrow it with --cluster, --namespace and --pod"
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One recording as the listing shows it.
fn line(sidecar: &Sidecar) -> String {
    let time = chrono::DateTime::from_timestamp_micros((sidecar.time * 1e6) as i64)
        .map_or_else(String::new, |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string());
    let gib = |bytes: u64| format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64);
    let oom = match (sidecar.device, sidecar.oom) {
        (Some(device), Some(oom)) => format!(
            "OOM on device {device}: {} asked, {} free, {} reserved",
            gib(oom.requested_bytes),
            gib(oom.device_free_bytes),
            gib(oom.reserved_bytes)
        ),
        _ => "no OOM recorded".to_string(),
    };
    // The names and address come from the key (validated); the rest are numbers.
    format!(
        "{time}  {}/{}/{}  pid {}  {oom}  {}",
        sidecar.cluster, sidecar.namespace, sidecar.pod, sidecar.pid, sidecar.recording
    )
}
