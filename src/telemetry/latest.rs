//! A source's latest report beside its last good answer, shared between the task that asks the
//! source and the scrapes that read it.
//!
//! # Invariants
//! - The answer changes only with a successful read; a failed read changes only the report, so
//!   the last good answer stands while the source is down.
//! - Readers never wait for the source: they clone two `Arc`s under a short lock.

use std::sync::{Arc, Mutex, PoisonError};

use super::SourceReport;

struct State<A> {
    report: Arc<SourceReport>,
    answer: Arc<A>,
}

/// The latest word from a source whose answers are `A`.
pub struct Latest<A> {
    source: &'static str,
    state: Arc<Mutex<State<A>>>,
}

impl<A> Clone for Latest<A> {
    fn clone(&self) -> Self {
        Latest {
            source: self.source,
            state: Arc::clone(&self.state),
        }
    }
}

impl<A: Default> Latest<A> {
    /// Not read yet: down for `why`, with an empty answer.
    pub fn new(source: &'static str, why: &str) -> Self {
        Latest {
            source,
            state: Arc::new(Mutex::new(State {
                report: Arc::new(SourceReport::down(source, why.into(), 0.0)),
                answer: Arc::default(),
            })),
        }
    }
}

impl<A> Latest<A> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<A>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The latest report (up or down, and why).
    pub fn report(&self) -> Arc<SourceReport> {
        Arc::clone(&self.lock().report)
    }

    /// The last good answer.
    pub fn answer(&self) -> Arc<A> {
        Arc::clone(&self.lock().answer)
    }

    /// Publishes a successful read taking `duration_seconds`; true if the source was down.
    pub fn up(&self, answer: A, duration_seconds: f64) -> bool {
        let mut state = self.lock();
        let was_down = !state.report.up;
        state.answer = Arc::new(answer);
        state.report = Arc::new(SourceReport::up(self.source, None, duration_seconds));
        was_down
    }

    /// Publishes a failed read taking `duration_seconds`; true if `reason` is news (the source
    /// was up, or down for another reason).
    pub fn down(&self, reason: String, duration_seconds: f64) -> bool {
        let mut state = self.lock();
        let news = state.report.error.as_deref() != Some(reason.as_str());
        state.report = Arc::new(SourceReport::down(self.source, reason, duration_seconds));
        news
    }
}
