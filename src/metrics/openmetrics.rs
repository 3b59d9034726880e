//! The OpenMetrics 1.0 text exposition of the gathered families, for scrapers that ask for it
//! first (every Prometheus since 2.5 does; `Accept` negotiation is the server's).
//!
//! What differs from the 0.0.4 text format, and how each family is written:
//! - A counter's family is named without `_total`, and its samples keep it
//!   (`# TYPE gpumem_x counter`, `gpumem_x_total 3`). Every series therefore has the same
//!   name in both formats. A counter whose name lacks `_total` (none in the contract) is
//!   written as `unknown` under its own name, for the same reason.
//! - A gauge named `*_info` whose every value is 1 is an `info` family named without
//!   `_info` (`# TYPE gpumem_build info`, `gpumem_build_info{version="…"} 1`).
//! - `HELP` text escapes `"` too; numbers are `+Inf`, `-Inf` and `NaN` where Rust would write
//!   `inf`; timestamps are in seconds; the exposition ends with `# EOF`.
//!
//! # Invariants
//! - Output is a pure function of the families; a family of another type (the collectors
//!   make gauges and counters only) is an error, never a partial exposition.

use std::fmt::Write;

use prometheus::proto::{MetricFamily, MetricType};

/// The Content-Type of this exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a family is written as.
enum Shape<'a> {
    /// `# TYPE family counter`; samples named `family_total`.
    Counter { family: &'a str },
    /// `# TYPE family info`; samples named `family_info`.
    Info { family: &'a str },
    /// `gauge` or `unknown`, family and samples under one name.
    Plain { kind: &'static str },
}

/// A family the encoder does not write.
#[derive(Debug, thiserror::Error)]
#[error("metric family {name} has type {kind:?}, which the OpenMetrics encoder does not write")]
pub struct Unsupported {
    /// The family's name.
    pub name: String,
    /// Its type.
    pub kind: MetricType,
}

/// The OpenMetrics 1.0 text of `families`, `# EOF` included.
///
/// # Errors
/// [`Unsupported`] for a histogram, summary or untyped family.
pub fn encode(families: &[MetricFamily]) -> Result<String, Unsupported> {
    let mut out = String::with_capacity(64 * 1024);
    for family in families {
        write_family(&mut out, family)?;
    }
    out.push_str("# EOF\n");
    Ok(out)
}

fn shape(family: &MetricFamily) -> Result<Shape<'_>, Unsupported> {
    let name = family.name();
    match family.get_field_type() {
        MetricType::COUNTER => Ok(match name.strip_suffix("_total") {
            Some(family) => Shape::Counter { family },
            None => Shape::Plain { kind: "unknown" },
        }),
        MetricType::GAUGE => {
            let ones = family
                .get_metric()
                .iter()
                .all(|m| m.get_gauge().get_value() == 1.0);
            Ok(match name.strip_suffix("_info") {
                Some(family) if ones => Shape::Info { family },
                _ => Shape::Plain { kind: "gauge" },
            })
        }
        kind => Err(Unsupported {
            name: name.to_string(),
            kind,
        }),
    }
}

fn write_family(out: &mut String, family: &MetricFamily) -> Result<(), Unsupported> {
    let name = family.name();
    let (family_name, kind) = match shape(family)? {
        Shape::Counter { family } => (family, "counter"),
        Shape::Info { family } => (family, "info"),
        Shape::Plain { kind } => (name, kind),
    };
    let _ = writeln!(out, "# TYPE {family_name} {kind}");
    if !family.help().is_empty() {
        let _ = writeln!(out, "# HELP {family_name} {}", Escaped(family.help()));
    }
    for metric in family.get_metric() {
        out.push_str(name);
        let labels = metric.get_label();
        if !labels.is_empty() {
            out.push('{');
            for (i, label) in labels.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{}=\"{}\"", label.name(), Escaped(label.value()));
            }
            out.push('}');
        }
        let value = match family.get_field_type() {
            MetricType::COUNTER => metric.get_counter().get_value(),
            _ => metric.get_gauge().get_value(),
        };
        out.push(' ');
        write_number(out, value);
        let ms = metric.timestamp_ms();
        if ms != 0 {
            out.push(' ');
            write_number(out, ms as f64 / 1000.0);
        }
        out.push('\n');
    }
    Ok(())
}

/// A number as OpenMetrics spells it.
fn write_number(out: &mut String, value: f64) {
    if value.is_nan() {
        out.push_str("NaN");
    } else if value.is_infinite() {
        out.push_str(if value > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{value}");
    }
}

/// Label values and help text, escaped as OpenMetrics asks: `\\`, `\"` and `\n`.
struct Escaped<'a>(&'a str);

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for c in self.0.chars() {
            match c {
                '\\' => f.write_str("\\\\")?,
                '"' => f.write_str("\\\"")?,
                '\n' => f.write_str("\\n")?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use prometheus::core::Collector;
    use prometheus::{Counter, Gauge, GaugeVec, Histogram, HistogramOpts, Opts};

    use super::*;

    fn family(collector: &dyn Collector) -> MetricFamily {
        collector.collect().remove(0)
    }

    #[test]
    fn counters_info_gauges_and_escapes_as_openmetrics_writes_them() {
        let counter = Counter::new("gpumem_pushes_total", "Pushes \"taken\".").expect("valid");
        counter.inc_by(3.0);
        let info = GaugeVec::new(Opts::new("gpumem_build_info", "The build."), &["version"])
            .expect("valid");
        info.with_label_values(&["0.1 \"x\"\\\n"]).set(1.0);
        let gauge = Gauge::new("gpumem_free_bytes", "Free bytes.\nSecond line.").expect("valid");
        gauge.set(f64::INFINITY);
        let not_info = Gauge::new("gpumem_weird_info", "Not one.").expect("valid");
        not_info.set(2.0);
        let untotalled = Counter::new("gpumem_events", "No suffix.").expect("valid");
        let text = encode(&[
            family(&counter),
            family(&info),
            family(&gauge),
            family(&not_info),
            family(&untotalled),
        ])
        .expect("encodes");
        assert_eq!(
            text,
            "# TYPE gpumem_pushes counter\n\
             # HELP gpumem_pushes Pushes \\\"taken\\\".\n\
             gpumem_pushes_total 3\n\
             # TYPE gpumem_build info\n\
             # HELP gpumem_build The build.\n\
             gpumem_build_info{version=\"0.1 \\\"x\\\"\\\\\\n\"} 1\n\
             # TYPE gpumem_free_bytes gauge\n\
             # HELP gpumem_free_bytes Free bytes.\\nSecond line.\n\
             gpumem_free_bytes +Inf\n\
             # TYPE gpumem_weird_info gauge\n\
             # HELP gpumem_weird_info Not one.\n\
             gpumem_weird_info 2\n\
             # TYPE gpumem_events unknown\n\
             # HELP gpumem_events No suffix.\n\
             gpumem_events 0\n\
             # EOF\n"
        );
    }

    #[test]
    fn an_empty_gather_is_an_eof_alone_and_a_histogram_is_refused() {
        assert_eq!(encode(&[]).expect("encodes"), "# EOF\n");
        let histogram =
            Histogram::with_opts(HistogramOpts::new("gpumem_latency_seconds", "Latency."))
                .expect("valid");
        let refused = encode(&[family(&histogram)]).expect_err("refused");
        assert_eq!(refused.name, "gpumem_latency_seconds");
        let nan = Gauge::new("gpumem_ratio", "Ratio.").expect("valid");
        nan.set(f64::NAN);
        assert!(
            encode(&[family(&nan)])
                .expect("encodes")
                .contains("gpumem_ratio NaN\n")
        );
    }
}
