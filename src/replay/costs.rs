//! The driver-cost file (`--costs`, written by `scripts/gpu-check.sh`): a GPU kind's table of
//! what each driver call costs ([`DriverCosts`]), in its envelope, read within
//! [`MAX_COSTS_FILE_BYTES`] and validated ([`DriverCosts::validate`]).
//!
//! ```json
//! {"format": "gpumem-costs", "version": 1, "gpu": "NVIDIA H200",
//!  "calls": {"malloc": {"points": [[2097152, 62300]], "includes_synchronize": true,
//!                       "source": {"measured": "NVIDIA H200, scripts/gpu-check.sh"}}, …}}
//! ```
//!
//! Every call of [`Call::ALL`] has an entry; unknown fields and calls are refused.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::device::{Call, CallCost, CostsError, DriverCosts};

/// The largest cost file read.
pub const MAX_COSTS_FILE_BYTES: u64 = 64 << 10;
/// The file's `format` field.
pub const COSTS_FORMAT: &str = "gpumem-costs";
/// The version this build reads and writes.
pub const COSTS_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CostsFile {
    format: String,
    version: u32,
    gpu: String,
    calls: BTreeMap<Call, CallCost>,
}

/// Why a cost table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CostsFileError {
    /// The file cannot be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// It is larger than [`MAX_COSTS_FILE_BYTES`].
    #[error("{0}: larger than {MAX_COSTS_FILE_BYTES} bytes, not a cost table")]
    TooLarge(String),
    /// Its text is not a valid cost table.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        source: CostsFormatError,
    },
}

/// Why a text is not a valid cost table.
#[derive(Debug, thiserror::Error)]
pub enum CostsFormatError {
    /// Not a cost table of this version.
    #[error("not a {COSTS_FORMAT} version {COSTS_VERSION} table: {0}")]
    Format(String),
    /// Its figures are out of bounds.
    #[error(transparent)]
    Figures(#[from] CostsError),
}

/// The file's text for `costs`.
pub fn costs_json(costs: &DriverCosts) -> String {
    let file = CostsFile {
        format: COSTS_FORMAT.into(),
        version: COSTS_VERSION,
        gpu: costs.gpu.clone(),
        calls: costs.calls.clone(),
    };
    serde_json::to_string_pretty(&file).unwrap_or_default()
}

/// A table by name: `h200` or `public` (the built-in tables), else a cost file's path.
///
/// # Errors
/// A [`CostsFileError`]: unreadable, too large, another format, or figures out of bounds.
pub fn read_costs(name_or_path: &str) -> Result<DriverCosts, CostsFileError> {
    match name_or_path {
        "h200" => return Ok(DriverCosts::h200()),
        "public" => return Ok(DriverCosts::public()),
        _ => {}
    }
    use crate::bounded_file::{ReadError, read};
    let path = name_or_path.to_string();
    let text = read(name_or_path.as_ref(), MAX_COSTS_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(source) => CostsFileError::Io {
            path: path.clone(),
            source,
        },
        ReadError::TooLarge(_) => CostsFileError::TooLarge(path.clone()),
    })?;
    parse_costs(&text).map_err(|source| CostsFileError::Invalid { path, source })
}

/// Reads a cost table from the file's text.
///
/// # Errors
/// A [`CostsFormatError`]: another format or version, or figures out of bounds.
pub fn parse_costs(text: &str) -> Result<DriverCosts, CostsFormatError> {
    let file: CostsFile =
        serde_json::from_str(text).map_err(|e| CostsFormatError::Format(e.to_string()))?;
    if file.format != COSTS_FORMAT || file.version != COSTS_VERSION {
        return Err(CostsFormatError::Format(format!(
            "format {:?} version {}",
            file.format, file.version
        )));
    }
    let costs = DriverCosts {
        gpu: file.gpu,
        calls: file.calls,
    };
    costs.validate()?;
    Ok(costs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_tables_read_back_from_their_files() {
        for costs in [DriverCosts::h200(), DriverCosts::public()] {
            assert_eq!(parse_costs(&costs_json(&costs)).expect("reads"), costs);
        }
        assert_eq!(read_costs("h200").expect("built in"), DriverCosts::h200());
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let good = costs_json(&DriverCosts::public());
        let cases = [
            (good.replace("gpumem-costs", "gpumem-plan"), "format"),
            (
                good.replace("\"version\": 1", "\"version\": 2"),
                "version 2",
            ),
            (good.replace("\"remap\"", "\"remapped\""), "unknown variant"),
            (
                good.replace("\"gpu\"", "\"extra\": 1, \"gpu\""),
                "unknown field",
            ),
            (
                good.replace("\"includes_synchronize\": false", "\"cost\": 1"),
                "unknown field",
            ),
            ("[]".to_string(), "expected"),
            (String::from_utf8_lossy(&[b'{'; 100]).into_owned(), "key"),
        ];
        for (text, why) in cases {
            let e = parse_costs(&text).expect_err(why).to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        let mut missing: serde_json::Value = serde_json::from_str(&good).expect("JSON");
        missing["calls"]
            .as_object_mut()
            .expect("calls")
            .remove("release");
        let e = parse_costs(&missing.to_string()).expect_err("missing");
        assert!(e.to_string().contains("no cost for release"), "{e}");
        let mut unordered = missing;
        unordered["calls"]["release"] = serde_json::json!({
            "points": [[4, 1], [2, 1]], "source": {"public": "x"}});
        let e = parse_costs(&unordered.to_string()).expect_err("unordered");
        assert!(
            e.to_string().contains("release: sizes must increase"),
            "{e}"
        );
    }

    #[test]
    fn files_are_read_within_their_budget() {
        let dir = std::env::temp_dir().join(format!("gpumem-costs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let big = dir.join("big.json");
        std::fs::write(&big, vec![b' '; MAX_COSTS_FILE_BYTES as usize + 1]).expect("write");
        let e = read_costs(big.to_str().expect("UTF-8")).expect_err("too large");
        assert!(matches!(e, CostsFileError::TooLarge(_)), "{e}");
        let e = read_costs("/nonexistent/costs.json").expect_err("missing");
        assert!(
            e.to_string().starts_with("/nonexistent/costs.json: "),
            "{e}"
        );
        let ok = dir.join("ok.json");
        std::fs::write(&ok, costs_json(&DriverCosts::h200())).expect("write");
        assert_eq!(
            read_costs(ok.to_str().expect("UTF-8")).expect("reads"),
            DriverCosts::h200()
        );
        std::fs::remove_dir_all(&dir).expect("cleaned up");
    }
}
