//! Liveness and readiness of the agent's loops, for `/healthz` and `/readyz`.
//!
//! Each loop (the NVML poller, the kubelet watch) beats its [`Heartbeat`] after every round,
//! whatever the round found: a source that answers with an error is alive. [`Health`] gathers
//! them.
//!
//! # Invariants
//! - Live means every loop finished a round within its allowance (a hung driver call or a dead
//!   thread makes the agent not live, so the kubelet restarts it); a source being down never
//!   does (a driverless node would otherwise be restarted forever).
//! - Ready means every loop finished at least one round: the first collection was attempted,
//!   so a scrape has something to say, up or down.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The last round of one loop.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    name: &'static str,
    allowance: Duration,
    started: Instant,
    last: Arc<Mutex<Option<Instant>>>,
}

impl Heartbeat {
    /// A loop named `name` that must finish a round at least every `allowance`.
    pub fn new(name: &'static str, allowance: Duration) -> Heartbeat {
        Heartbeat {
            name,
            allowance,
            started: Instant::now(),
            last: Arc::default(),
        }
    }

    /// The allowance for a loop that runs every `interval`: three missed rounds plus a
    /// minute, so that one slow round (NVML on many GPUs takes seconds) is no failure.
    pub fn allowance_for(interval: Duration) -> Duration {
        interval
            .saturating_mul(3)
            .saturating_add(Duration::from_secs(60))
    }

    /// A round finished.
    pub fn beat(&self) {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    fn last(&self) -> Option<Instant> {
        *self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Why the loop is not live at `now`, if it is not.
    fn stalled(&self, now: Instant) -> Option<String> {
        let since = self.last().unwrap_or(self.started);
        let quiet = now.saturating_duration_since(since);
        (quiet > self.allowance).then(|| {
            format!(
                "{}: no round finished for {} s (allowed {} s)",
                self.name,
                quiet.as_secs(),
                self.allowance.as_secs()
            )
        })
    }
}

/// Every loop of the agent.
#[derive(Clone, Debug, Default)]
pub struct Health {
    beats: Vec<Heartbeat>,
}

impl Health {
    /// Watches `beat` too.
    pub fn watch(&mut self, beat: Heartbeat) {
        self.beats.push(beat);
    }

    /// `Ok` while every loop keeps finishing rounds, else which ones do not.
    ///
    /// # Errors
    /// [`Unhealthy::Stalled`]: the stalled loops, one line each.
    pub fn live(&self) -> Result<(), Unhealthy> {
        let now = Instant::now();
        let stalled: Vec<String> = self.beats.iter().filter_map(|b| b.stalled(now)).collect();
        if stalled.is_empty() {
            Ok(())
        } else {
            Err(Unhealthy::Stalled(stalled))
        }
    }

    /// `Ok` once every loop has finished a round, else which ones have not.
    ///
    /// # Errors
    /// [`Unhealthy::Starting`]: the loops still in their first round.
    pub fn ready(&self) -> Result<(), Unhealthy> {
        let waiting: Vec<&str> = self
            .beats
            .iter()
            .filter(|b| b.last().is_none())
            .map(|b| b.name)
            .collect();
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(Unhealthy::Starting(waiting))
        }
    }
}

/// Why the agent is not live or not ready; its text is the probe's answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unhealthy {
    /// Loops that stopped finishing rounds, each described on its own line.
    #[error("{}", .0.join("\n"))]
    Stalled(Vec<String>),
    /// Loops still in their first round.
    #[error("first collection not done: {}", .0.join(", "))]
    Starting(Vec<&'static str>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_is_ready_after_its_first_round_and_live_while_it_keeps_beating() {
        let beat = Heartbeat::new("nvml", Duration::from_secs(60));
        let mut health = Health::default();
        health.watch(beat.clone());
        let why = health.ready().expect_err("not ready before a round");
        assert_eq!(why, Unhealthy::Starting(vec!["nvml"]));
        assert_eq!(why.to_string(), "first collection not done: nvml");
        assert!(health.live().is_ok(), "a loop in its first round is live");
        beat.beat();
        assert!(health.ready().is_ok());
        assert!(health.live().is_ok());
    }

    #[test]
    fn a_loop_quiet_beyond_its_allowance_is_not_live() {
        let beat = Heartbeat::new("kubelet", Duration::ZERO);
        beat.beat();
        std::thread::sleep(Duration::from_millis(5));
        let mut health = Health::default();
        health.watch(beat);
        let why = health.live().expect_err("stalled").to_string();
        assert!(why.starts_with("kubelet: no round finished"), "{why}");
        assert!(health.ready().is_ok(), "it did finish a round");
    }

    #[test]
    fn no_loops_is_live_and_ready() {
        assert!(Health::default().live().is_ok());
        assert!(Health::default().ready().is_ok());
    }

    #[test]
    fn the_allowance_grows_with_the_interval() {
        assert_eq!(
            Heartbeat::allowance_for(Duration::from_secs(5)),
            Duration::from_secs(75)
        );
        assert_eq!(Heartbeat::allowance_for(Duration::MAX), Duration::MAX);
    }
}
