//! Admission, a push's third phase: whether it may write its pid's entry.
//!
//! # Invariants
//! - The kernel's word outranks the node's, and both a payload's: a pid a socket pusher holds
//!   is never written from the pod network or loopback, nor a pod's from loopback.
//! - A live loopback job's entry is not replaced by a push giving another start time.
//! - Sequence numbers of a process only grow, by at most [`MAX_SEQ_JUMP`] a push.
//! - A process pushes at most once per `min_interval`, except its `"oom"` and `"exit"`
//!   pushes: a token bucket of [`MAX_REASON_PUSHES`] such pushes past the limit, one given
//!   back every [`REASON_REFILL`].

use std::time::{Duration, Instant};

use super::attribution::{Identity, Origin};
use super::config::IngestConfig;
use super::payload::{Reason, ValidPush};
use super::refusal::{Refusal, Rejected};

/// The largest step between two sequence numbers of one process.
pub const MAX_SEQ_JUMP: u64 = 1 << 20;
/// `"oom"` and `"exit"` pushes a process may send past the rate limit in a burst.
pub const MAX_REASON_PUSHES: u32 = 8;
/// How often one of those comes back to a process that spent it.
pub const REASON_REFILL: Duration = Duration::from_secs(60);

/// A process's urgent pushes past the rate limit, spent and not yet given back (a token
/// bucket of [`MAX_REASON_PUSHES`], refilled one per [`REASON_REFILL`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Allowance {
    pub spent: u32,
    /// When the oldest spent one started coming back.
    since: Instant,
}

impl Allowance {
    pub fn new(now: Instant) -> Allowance {
        Allowance {
            spent: 0,
            since: now,
        }
    }

    /// The allowance at `now`: one spent push given back per whole [`REASON_REFILL`].
    pub fn at(self, now: Instant) -> Allowance {
        let elapsed = now.saturating_duration_since(self.since).as_nanos();
        let back = (elapsed / REASON_REFILL.as_nanos()).min(u128::from(self.spent)) as u32;
        if back == self.spent {
            return Allowance::new(now);
        }
        Allowance {
            spent: self.spent - back,
            since: self.since + REASON_REFILL * back,
        }
    }
}

/// The tracked entry of a push's pid, as admission reads it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry<'a> {
    /// Who vouched for its pid.
    pub origin: &'a Origin,
    /// Its start time, where known.
    pub start_time: Option<u64>,
    /// Its last accepted push's sequence number, and when that came.
    pub seq: u64,
    pub last: Instant,
    /// Its urgent pushes past the rate limit.
    pub allowance: Allowance,
    /// When it ended, or will have if it stays silent.
    pub end: Instant,
}

/// What admitting a push found.
#[derive(Clone, Copy, Default)]
pub(super) struct Admission {
    /// It is the tracked process's next push (else it starts a new entry).
    pub replaces: bool,
    /// It came too soon and uses the allowance of urgent pushes.
    pub urgent: bool,
}

/// Whether a push from `who` may write its pid's entry (`tracked`, where one is): not over
/// a higher-ranked sender's, not over a live loopback job of another start time, and, from
/// the same process, in order and not too often.
pub(super) fn admit(
    config: &IngestConfig,
    tracked: Option<Entry<'_>>,
    push: &ValidPush,
    who: &Identity,
    now: Instant,
) -> Result<Admission, Rejected> {
    let pid = push.pid;
    let origin = &who.origin;
    let mut admitted = Admission::default();
    let Some(t) = tracked else {
        return Ok(admitted);
    };
    let same_process = *t.origin == *origin && t.start_time == who.start_time;
    // The kernel's word stands over the node's (which proves a pod's process exists,
    // not that it pushed), and both over a payload's.
    let outranked = match (t.origin, origin) {
        (Origin::Socket, Origin::Socket) => false,
        (Origin::Socket, _) => true,
        (Origin::Pod(_), Origin::Tcp) => true,
        _ => false,
    };
    if outranked {
        return Err(Rejected::new(
            Refusal::Conflict,
            format!(
                "pid {pid} pushes over the agent's {}; pushes from {} cannot write it",
                if *t.origin == Origin::Socket {
                    "socket"
                } else {
                    "pod network"
                },
                if *origin == Origin::Tcp {
                    "loopback"
                } else {
                    "the pod network"
                }
            ),
        ));
    }
    // A loopback pid and start time are the payload's word: another's cannot take a
    // live loopback job's series (another local user's, a stale pid's).
    if *t.origin == Origin::Tcp && *origin == Origin::Tcp && !same_process && t.end > now {
        // (Its start time is not said: not to help another guess it.)
        return Err(Rejected::new(
            Refusal::Conflict,
            format!(
                "pid {pid} is a live loopback job's, of another start time; a push cannot replace it until it ends (its exit push, or {:?} of silence): push over the agent's socket",
                config.ttl
            ),
        ));
    }
    if same_process {
        admitted.urgent = check_order(config, &t, push, now)?;
        admitted.replaces = true;
    }
    // Otherwise a new process under a dead one's pid (or the kernel now names a pid
    // a TCP push claimed): it replaces the old entry.
    Ok(admitted)
}

/// A push of a known process: after its last, not too far after, not too soon. `true`
/// when it is an urgent push that came too soon and uses the allowance.
fn check_order(
    config: &IngestConfig,
    t: &Entry<'_>,
    push: &ValidPush,
    now: Instant,
) -> Result<bool, Rejected> {
    let pid = push.pid;
    if push.seq <= t.seq {
        return Err(Rejected::new(
            Refusal::Stale,
            format!(
                "seq {} is not after the last accepted seq {} of pid {pid}",
                push.seq, t.seq
            ),
        ));
    }
    if push.seq - t.seq > MAX_SEQ_JUMP {
        return Err(Rejected::new(
            Refusal::Invalid,
            format!(
                "seq {} jumps more than {MAX_SEQ_JUMP} past the last accepted seq {} of pid {pid}",
                push.seq, t.seq
            ),
        ));
    }
    let soon = now.saturating_duration_since(t.last) < config.min_interval;
    if !soon {
        return Ok(false);
    }
    if push.reason != Reason::Interval && t.allowance.at(now).spent < MAX_REASON_PUSHES {
        return Ok(true);
    }
    Err(Rejected::new(
        Refusal::RateLimited,
        format!(
            "pid {pid} pushes more often than every {:?}",
            config.min_interval
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::payload::validate;

    fn push(seq: u64, reason: &str) -> ValidPush {
        let body = serde_json::json!({"pid": 7, "seq": seq, "reason": reason,
            "devices": [{"index": 0, "uuid": "GPU-a", "stats": {}}]});
        validate(body.to_string().as_bytes()).expect("valid")
    }

    fn who(origin: Origin, start_time: Option<u64>) -> Identity {
        Identity {
            origin,
            start_time,
            container: None,
            pod_names: None,
        }
    }

    /// The entry of a process of `origin` and `start_time` whose last push was `seq`, at
    /// `last`, silent from then on.
    fn pushed(origin: &Origin, start_time: Option<u64>, seq: u64, last: Instant) -> Entry<'_> {
        Entry {
            origin,
            start_time,
            seq,
            last,
            allowance: Allowance::new(last),
            end: last + IngestConfig::default().ttl,
        }
    }

    fn refusal(result: Result<Admission, Rejected>) -> Option<Refusal> {
        result.err().map(|r| r.refusal)
    }

    #[test]
    fn the_kernels_word_outranks_the_nodes_and_both_the_payloads() {
        let c = IngestConfig::default();
        let now = Instant::now();
        let pod = || Origin::Pod("p".into());
        let (socket_origin, pod_origin) = (Origin::Socket, pod());
        let socket = pushed(&socket_origin, Some(1), 1, now);
        let of_pod = pushed(&pod_origin, Some(1), 1, now);
        let cases = [
            (&socket, who(Origin::Tcp, Some(1)), Some(Refusal::Conflict)),
            (&socket, who(pod(), Some(1)), Some(Refusal::Conflict)),
            (&of_pod, who(Origin::Tcp, Some(1)), Some(Refusal::Conflict)),
            // A new process the kernel names under a pod's (or a payload's) pid takes it.
            (&of_pod, who(Origin::Socket, Some(2)), None),
        ];
        for (tracked, sender, expected) in cases {
            let admitted = admit(&c, Some(*tracked), &push(2, "interval"), &sender, now);
            assert_eq!(refusal(admitted), expected, "{:?}", sender.origin);
        }
        // Unknown pid: a new entry.
        let fresh = admit(&c, None, &push(1, "interval"), &who(Origin::Tcp, None), now);
        assert!(fresh.is_ok_and(|a| !a.replaces && !a.urgent));
    }

    #[test]
    fn a_live_loopback_job_keeps_its_pid_until_it_ends() {
        let c = IngestConfig::default();
        let now = Instant::now();
        let tracked = pushed(&Origin::Tcp, Some(1), 1, now);
        let other = who(Origin::Tcp, Some(2));
        let p = push(2, "interval");
        assert_eq!(
            refusal(admit(&c, Some(tracked), &p, &other, now)),
            Some(Refusal::Conflict)
        );
        let later = now + c.ttl;
        let replaced = admit(&c, Some(tracked), &p, &other, later);
        assert!(
            replaced.is_ok_and(|a| !a.replaces),
            "a new entry once it ended"
        );
    }

    #[test]
    fn a_process_pushes_in_order_and_not_too_often_but_its_ooms_get_through() {
        let c = IngestConfig::default();
        let now = Instant::now();
        let me = who(Origin::Socket, Some(1));
        let tracked = pushed(&Origin::Socket, Some(1), 5, now);
        let at = |seq, reason, when| admit(&c, Some(tracked), &push(seq, reason), &me, when);
        assert_eq!(
            refusal(at(5, "interval", now + c.min_interval)),
            Some(Refusal::Stale)
        );
        let jump = 5 + MAX_SEQ_JUMP + 1;
        assert_eq!(
            refusal(at(jump, "interval", now + c.min_interval)),
            Some(Refusal::Invalid)
        );
        assert_eq!(refusal(at(6, "interval", now)), Some(Refusal::RateLimited));
        assert!(at(6, "interval", now + c.min_interval).is_ok_and(|a| a.replaces && !a.urgent));
        assert!(at(6, "oom", now).is_ok_and(|a| a.replaces && a.urgent));
        // With the allowance spent, an urgent push waits too.
        let mut spent = pushed(&Origin::Socket, Some(1), 5, now);
        spent.allowance.spent = MAX_REASON_PUSHES;
        let refused = admit(&c, Some(spent), &push(6, "exit"), &me, now);
        assert_eq!(refusal(refused), Some(Refusal::RateLimited));
    }

    #[test]
    fn the_allowance_comes_back_one_push_per_refill() {
        let now = Instant::now();
        let spent = Allowance {
            spent: 3,
            since: now,
        };
        assert_eq!(spent.at(now + REASON_REFILL / 2).spent, 3);
        assert_eq!(spent.at(now + REASON_REFILL).spent, 2);
        assert_eq!(
            spent.at(now + 2 * REASON_REFILL + REASON_REFILL / 2).spent,
            1
        );
        assert_eq!(spent.at(now + 10 * REASON_REFILL).spent, 0);
    }
}
