//! Budgeting, a push's fourth phase: whether the series and processes it would hold fit the
//! agent's caps, and which ended processes to evict so that they do. Pure: it reads the
//! tracked processes as [`Holder`]s and decides; the store evicts.
//!
//! # Invariants
//! - Caps are checked in one order ([`Over`]), and a refusal names the first exceeded.
//! - Only ended processes are evicted, oldest end first, and only those that free some of
//!   what is short (an ended socket pusher stays while only TCP's share is short).
//! - Eviction happens only if it is enough: otherwise nothing is evicted and the push is
//!   refused.
//! - A process pushing over TCP holds at most [`IngestConfig::tcp_process_series`].

use std::time::Instant;

use super::attribution::Origin;
use super::config::IngestConfig;
use super::refusal::{Refusal, Rejected};

/// A tracked process as the budget counts it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Holder<'a> {
    pub pid: u32,
    pub origin: &'a Origin,
    pub series: usize,
    /// When it ended, or will have if it stays silent.
    pub end: Instant,
}

/// The ended processes to evict (oldest end first) so that `pid`'s push from `origin`,
/// holding `series` series, fits beside the other processes `held` and the per-pod OOM
/// counters' series (`counters`).
///
/// # Errors
/// `series_budget` or `capacity`, naming the first cap that evicting cannot bring back.
pub(super) fn room(
    config: &IngestConfig,
    held: &[Holder<'_>],
    counters: usize,
    pid: u32,
    origin: &Origin,
    series: usize,
    now: Instant,
) -> Result<Vec<u32>, Rejected> {
    if *origin == Origin::Tcp && series > config.tcp_process_series() {
        return Err(Rejected::new(
            Refusal::SeriesBudget,
            format!(
                "pid {pid} would hold {series} series; a process pushing over TCP holds at most {} (push over the agent's socket)",
                config.tcp_process_series()
            ),
        ));
    }
    let pod = origin.pod();
    let others = || held.iter().filter(|h| h.pid != pid);
    let mut load = Load::of(origin, series, pod);
    load.series += counters;
    for h in others() {
        load += Load::of(h.origin, h.series, pod);
    }
    if load.over(config).is_none() {
        return Ok(Vec::new());
    }
    let mut ended: Vec<&Holder<'_>> = others().filter(|h| h.end <= now).collect();
    ended.sort_unstable_by_key(|h| (h.end, h.pid));
    let mut evict = Vec::new();
    for h in ended {
        let Some(over) = load.over(config) else {
            break;
        };
        let freed = Load::of(h.origin, h.series, pod);
        let helps = match over {
            Over::Series | Over::Processes => true,
            Over::TcpSeries | Over::TcpProcesses => freed.tcp > 0,
            Over::NetworkSeries | Over::NetworkProcesses => freed.network > 0,
            Over::PodSeries | Over::PodProcesses => freed.pod > 0,
        };
        if helps {
            load -= freed;
            evict.push(h.pid);
        }
    }
    match load.over(config) {
        Some(over) => Err(over.refusal(config, series, pod)),
        None => Ok(evict),
    }
}

/// What the tracked processes hold, as the caps count it: of one pod's (the pushing pod's).
#[derive(Clone, Copy, Debug, Default)]
struct Load {
    processes: usize,
    series: usize,
    tcp: usize,
    tcp_series: usize,
    /// Of all pods' processes.
    network: usize,
    network_series: usize,
    pod: usize,
    pod_series: usize,
}

impl Load {
    /// One process of `origin` holding `series`, counted for `pod`'s quota where it is one
    /// of its processes.
    fn of(origin: &Origin, series: usize, pod: Option<&str>) -> Load {
        let tcp = usize::from(*origin == Origin::Tcp);
        let network = usize::from(origin.pod().is_some());
        let in_pod = usize::from(pod.is_some() && origin.pod() == pod);
        Load {
            processes: 1,
            series,
            tcp,
            tcp_series: tcp * series,
            network,
            network_series: network * series,
            pod: in_pod,
            pod_series: in_pod * series,
        }
    }

    /// The first cap exceeded, in the order refusals name them.
    fn over(&self, config: &IngestConfig) -> Option<Over> {
        [
            (self.series > config.max_series, Over::Series),
            (self.tcp_series > config.max_tcp_series, Over::TcpSeries),
            (
                self.network_series > config.max_pod_network_series,
                Over::NetworkSeries,
            ),
            (self.pod_series > config.max_pod_series, Over::PodSeries),
            (self.processes > config.max_processes, Over::Processes),
            (self.tcp > config.max_tcp_processes, Over::TcpProcesses),
            (
                self.network > config.max_pod_network_processes,
                Over::NetworkProcesses,
            ),
            (self.pod > config.max_pod_processes, Over::PodProcesses),
        ]
        .into_iter()
        .find_map(|(over, which)| over.then_some(which))
    }
}

impl std::ops::AddAssign for Load {
    fn add_assign(&mut self, other: Load) {
        self.processes += other.processes;
        self.series += other.series;
        self.tcp += other.tcp;
        self.tcp_series += other.tcp_series;
        self.network += other.network;
        self.network_series += other.network_series;
        self.pod += other.pod;
        self.pod_series += other.pod_series;
    }
}

impl std::ops::SubAssign for Load {
    fn sub_assign(&mut self, other: Load) {
        self.processes -= other.processes;
        self.series -= other.series;
        self.tcp -= other.tcp;
        self.tcp_series -= other.tcp_series;
        self.network -= other.network;
        self.network_series -= other.network_series;
        self.pod -= other.pod;
        self.pod_series -= other.pod_series;
    }
}

/// A cap a push would exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Over {
    Series,
    TcpSeries,
    NetworkSeries,
    PodSeries,
    Processes,
    TcpProcesses,
    NetworkProcesses,
    PodProcesses,
}

impl Over {
    /// The refusal of a push of `series` series (from `pod`, where it is one).
    fn refusal(self, config: &IngestConfig, series: usize, pod: Option<&str>) -> Rejected {
        let pod = pod.unwrap_or_default();
        let (refusal, message) = match self {
            Over::Series => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take the agent past its budget of {} pushed series",
                    config.max_series
                ),
            ),
            Over::TcpSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take processes pushing over TCP past their share of {} series (push over the agent's socket)",
                    config.max_tcp_series
                ),
            ),
            Over::NetworkSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take the pods pushing from the pod network past their share of {} series",
                    config.max_pod_network_series
                ),
            ),
            Over::PodSeries => (
                Refusal::SeriesBudget,
                format!(
                    "the push's {series} series would take pod {pod} past its share of {} series",
                    config.max_pod_series
                ),
            ),
            Over::Processes => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes, the most this agent keeps",
                    config.max_processes
                ),
            ),
            Over::TcpProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes pushing over TCP, the most this agent keeps",
                    config.max_tcp_processes
                ),
            ),
            Over::NetworkProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes pushing from the pod network, the most this agent keeps",
                    config.max_pod_network_processes
                ),
            ),
            Over::PodProcesses => (
                Refusal::Capacity,
                format!(
                    "already tracking {} processes of pod {pod}, the most this agent keeps of one pod",
                    config.max_pod_processes
                ),
            ),
        };
        Rejected::new(refusal, message)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn config() -> IngestConfig {
        IngestConfig {
            max_processes: 3,
            max_tcp_processes: 1,
            max_series: 100,
            max_tcp_series: 80,
            ..IngestConfig::default()
        }
    }

    fn holder(pid: u32, origin: &Origin, series: usize, end: Instant) -> Holder<'_> {
        Holder {
            pid,
            origin,
            series,
            end,
        }
    }

    fn refusal(result: Result<Vec<u32>, Rejected>) -> Option<Refusal> {
        result.err().map(|r| r.refusal)
    }

    #[test]
    fn ended_processes_make_room_oldest_first_and_only_as_many_as_needed() {
        let now = Instant::now();
        let (socket, tcp) = (Origin::Socket, Origin::Tcp);
        let s = Duration::from_secs(1);
        let held = [
            holder(1, &socket, 10, now - s),
            holder(2, &socket, 10, now - 2 * s),
            holder(3, &socket, 10, now + s),
        ];
        let c = config();
        assert_eq!(
            room(&c, &held[..2], 0, 9, &socket, 10, now).ok(),
            Some(vec![])
        );
        // A fourth process: the oldest ended one goes, the other ended one stays.
        assert_eq!(room(&c, &held, 0, 9, &socket, 10, now).ok(), Some(vec![2]));
        // Its own entry is replaced, not counted.
        assert_eq!(room(&c, &held, 0, 3, &socket, 10, now).ok(), Some(vec![]));
        // Series: the others hold 20; 85 more needs one evicted, 95 both, 101 cannot fit.
        assert_eq!(room(&c, &held, 0, 3, &socket, 85, now).ok(), Some(vec![2]));
        assert_eq!(
            room(&c, &held, 0, 3, &socket, 95, now).ok(),
            Some(vec![2, 1])
        );
        assert_eq!(
            refusal(room(&c, &held, 0, 3, &socket, 101, now)),
            Some(Refusal::SeriesBudget)
        );
        // The pods' OOM counters hold series too.
        assert_eq!(
            refusal(room(&c, &held[2..], 95, 9, &socket, 5, now)),
            Some(Refusal::SeriesBudget)
        );
        // Nothing ended: a fourth process is refused, and a live one is never evicted.
        let live = [
            holder(1, &socket, 1, now + s),
            holder(2, &tcp, 1, now + s),
            held[2],
        ];
        assert_eq!(
            refusal(room(&c, &live, 0, 9, &socket, 1, now)),
            Some(Refusal::Capacity)
        );
    }

    #[test]
    fn tcp_pushers_keep_to_their_share_and_free_only_their_own() {
        let now = Instant::now();
        let (socket, tcp) = (Origin::Socket, Origin::Tcp);
        let c = config();
        // One TCP process at most: an ended socket pusher frees nothing of that share.
        let ended_socket = [
            holder(1, &socket, 1, now),
            holder(2, &tcp, 1, now + Duration::from_secs(1)),
        ];
        assert_eq!(
            refusal(room(&c, &ended_socket, 0, 9, &tcp, 1, now)),
            Some(Refusal::Capacity)
        );
        let ended_tcp = [holder(1, &socket, 1, now), holder(2, &tcp, 1, now)];
        assert_eq!(room(&c, &ended_tcp, 0, 9, &tcp, 1, now).ok(), Some(vec![2]));
        // A TCP process holds at most a quarter of TCP's series.
        assert_eq!(c.tcp_process_series(), 20);
        assert_eq!(room(&c, &[], 0, 9, &tcp, 20, now).ok(), Some(vec![]));
        assert_eq!(
            refusal(room(&c, &[], 0, 9, &tcp, 21, now)),
            Some(Refusal::SeriesBudget)
        );
        // A socket pusher has no such cap.
        assert_eq!(room(&c, &[], 0, 9, &socket, 21, now).ok(), Some(vec![]));
    }

    #[test]
    fn a_pod_holds_its_share_and_the_pod_network_half() {
        let now = Instant::now();
        let (a, b) = (Origin::Pod("a".into()), Origin::Pod("b".into()));
        let c = IngestConfig {
            max_pod_processes: 1,
            max_pod_network_processes: 2,
            ..config()
        };
        let live = now + Duration::from_secs(1);
        let held = [holder(1, &a, 1, live)];
        // Pod a holds its one process; pod b may push beside it.
        assert_eq!(
            refusal(room(&c, &held, 0, 9, &a, 1, now)),
            Some(Refusal::Capacity)
        );
        assert_eq!(room(&c, &held, 0, 9, &b, 1, now).ok(), Some(vec![]));
        // Two pods' processes fill the pod network's share, not the socket's.
        let two = [holder(1, &a, 1, live), holder(2, &b, 1, live)];
        let c3 = Origin::Pod("c".into());
        assert_eq!(
            refusal(room(&c, &two, 0, 9, &c3, 1, now)),
            Some(Refusal::Capacity)
        );
        assert_eq!(
            room(&c, &two, 0, 9, &Origin::Socket, 1, now).ok(),
            Some(vec![])
        );
    }
}
