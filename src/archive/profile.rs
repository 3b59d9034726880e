//! The AWS CLI's profile files, read by gpumem's command line (never by the agent, whose
//! credentials come from its pod: workload identity or a Secret's environment): a laptop's
//! `aws configure` or `aws sso login`-free setup works as it does for the AWS CLI.
//!
//! `AWS_PROFILE` names the profile (`default` otherwise); `AWS_SHARED_CREDENTIALS_FILE`
//! (`~/.aws/credentials`, section `[name]`) gives its keys, `AWS_CONFIG_FILE`
//! (`~/.aws/config`, section `[profile name]`, or `[default]`) its region and
//! `endpoint_url`, and keys too where the credentials file has none. The environment wins:
//! a variable set there is never replaced, and no profile key is read where the environment
//! names credentials of its own (keys, or a web identity).
//!
//! # Invariants
//! - Each file is read within [`MAX_FILE_BYTES`]; a missing or unreadable file gives
//!   nothing, a larger one is refused with its name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The largest profile file read.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// The object store's options a profile gives: `(key, value)` for `AmazonS3Builder`.
pub type Options = Vec<(&'static str, String)>;

/// The settings of section `name` of an INI file's `text` (keys lowercased; comments and
/// other sections skipped).
fn section(text: &str, name: &str) -> HashMap<String, String> {
    let mut found = HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = header.trim() == name;
            continue;
        }
        if inside && let Some((key, value)) = line.split_once('=') {
            found.insert(key.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    found
}

/// The file `variable` names, else `~/.aws/<name>`.
fn file(variable: &str, name: &str) -> Option<PathBuf> {
    match std::env::var_os(variable) {
        Some(path) if !path.is_empty() => Some(PathBuf::from(path)),
        _ => std::env::var_os("HOME").map(|home| Path::new(&home).join(".aws").join(name)),
    }
}

fn read(path: &Path) -> Result<String, String> {
    match crate::bounded_file::read(path, MAX_FILE_BYTES) {
        Ok(text) => Ok(text),
        Err(crate::bounded_file::ReadError::Io(_)) => Ok(String::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The options the profile gives that the environment does not, read from the files named
/// as the AWS CLI names them.
///
/// # Errors
/// A profile file over [`MAX_FILE_BYTES`].
pub fn options() -> Result<Options, String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".to_string());
    let credentials = match file("AWS_SHARED_CREDENTIALS_FILE", "credentials") {
        Some(path) => section(&read(&path)?, &profile),
        None => HashMap::new(),
    };
    let config_section = if profile == "default" {
        profile.clone()
    } else {
        format!("profile {profile}")
    };
    let config = match file("AWS_CONFIG_FILE", "config") {
        Some(path) => section(&read(&path)?, &config_section),
        None => HashMap::new(),
    };
    Ok(merged(&credentials, &config, &env))
}

/// What `credentials` and `config` give, where `env` has not said.
fn merged(
    credentials: &HashMap<String, String>,
    config: &HashMap<String, String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Options {
    let mut options = Options::new();
    let from_files = |key: &str| credentials.get(key).or_else(|| config.get(key)).cloned();
    let own_credentials = env("AWS_ACCESS_KEY_ID").is_some()
        || env("AWS_WEB_IDENTITY_TOKEN_FILE").is_some()
        || env("AWS_CONTAINER_CREDENTIALS_FULL_URI").is_some()
        || env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI").is_some();
    if !own_credentials
        && let (Some(id), Some(secret)) = (
            from_files("aws_access_key_id"),
            from_files("aws_secret_access_key"),
        )
    {
        options.push(("aws_access_key_id", id));
        options.push(("aws_secret_access_key", secret));
        if let Some(token) = from_files("aws_session_token") {
            options.push(("aws_session_token", token));
        }
    }
    if env("AWS_REGION").is_none()
        && env("AWS_DEFAULT_REGION").is_none()
        && let Some(region) = config.get("region")
    {
        options.push(("aws_region", region.clone()));
    }
    if env("AWS_ENDPOINT_URL").is_none()
        && env("AWS_ENDPOINT").is_none()
        && let Some(endpoint) = config.get("endpoint_url")
    {
        options.push(("aws_endpoint", endpoint.clone()));
    }
    options
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREDENTIALS: &str = "\
[default]
aws_access_key_id = AKIADEFAULT
aws_secret_access_key = secret-default

[work]
# a comment
aws_access_key_id=AKIAWORK
aws_secret_access_key=secret-work
aws_session_token = token-work
";
    const CONFIG: &str = "\
[default]
region = eu-west-1
[profile work]
region = us-east-2
endpoint_url = http://127.0.0.1:9000
";

    fn options_of(profile: &str, env: &[(&str, &str)]) -> Options {
        let env = |name: &str| {
            env.iter()
                .find_map(|(k, v)| (*k == name).then(|| v.to_string()))
        };
        let config_section = if profile == "default" {
            profile.to_string()
        } else {
            format!("profile {profile}")
        };
        merged(
            &section(CREDENTIALS, profile),
            &section(CONFIG, &config_section),
            &env,
        )
    }

    #[test]
    fn a_profile_gives_what_the_environment_does_not() {
        let work = options_of("work", &[]);
        assert_eq!(
            work,
            vec![
                ("aws_access_key_id", "AKIAWORK".to_string()),
                ("aws_secret_access_key", "secret-work".to_string()),
                ("aws_session_token", "token-work".to_string()),
                ("aws_region", "us-east-2".to_string()),
                ("aws_endpoint", "http://127.0.0.1:9000".to_string()),
            ]
        );
        let default = options_of("default", &[("AWS_REGION", "ap-south-1")]);
        assert_eq!(
            default,
            vec![
                ("aws_access_key_id", "AKIADEFAULT".to_string()),
                ("aws_secret_access_key", "secret-default".to_string()),
            ],
            "the environment's region wins"
        );
        let irsa = options_of("work", &[("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/token")]);
        assert!(
            irsa.iter()
                .all(|(k, _)| !k.contains("key") && *k != "aws_session_token"),
            "a web identity is the environment's own credentials: {irsa:?}"
        );
        assert!(options_of("missing", &[]).is_empty());
    }
}
