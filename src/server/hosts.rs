//! Which `Host` a server answers to. A page of another site can make a browser send requests
//! to this address under the attacker's own name (DNS rebinding) and read the answers, so a
//! request must name the server as its clients do:
//! - the view (`gpumem view`, a local tool) answers only to the address it listens on and
//!   the loopback names ([`view_hosts`]);
//! - the agent answers to any IP address (Prometheus, the kubelet's probes and the live page
//!   reach a pod or a node by address), the loopback names, and the names it is given
//!   (`--allow-host`, for a scrape through a Service's DNS name) ([`AgentHosts`]). A rebinding
//!   page's requests carry a DNS name, never an address.
//!
//! # Invariants
//! - Names are compared lowercased, with or without the port.
//! - A `Host` that is not visible ASCII is refused.

/// The loopback names a local client may use.
const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// The `Host` values a view listening on `listen` (port `port`) answers to: `listen` itself
/// and the loopback names, with the port or without.
pub fn view_hosts(listen: &str, port: u16) -> Vec<String> {
    let mut hosts = vec![listen.to_ascii_lowercase()];
    for name in LOOPBACK {
        hosts.push(format!("{name}:{port}"));
        hosts.push(name.to_string());
    }
    hosts
}

/// The `Host` values the agent answers to: any IP address, the loopback names and the
/// configured names, each with any port or none.
#[derive(Clone, Debug, Default)]
pub struct AgentHosts {
    names: Vec<String>,
}

impl AgentHosts {
    /// IP addresses, the loopback names and `names` (DNS names, without a port).
    pub fn new(names: &[String]) -> AgentHosts {
        AgentHosts {
            names: names.iter().map(|n| n.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether a request whose `Host` header is `host` is answered.
    pub fn allows(&self, host: &str) -> bool {
        if host.is_empty() || !host.bytes().all(|b| b.is_ascii_graphic()) {
            return false;
        }
        let host = host.to_ascii_lowercase();
        let name = without_port(&host);
        let address = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
            Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => name.parse::<std::net::Ipv4Addr>().is_ok(),
        };
        address || LOOPBACK.contains(&name) || self.names.iter().any(|n| n == name)
    }
}

/// `host` without its `:port`, if it has one (`[::1]:9417` gives `[::1]`).
fn without_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((name, port))
            if !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!name.contains(':') || name.ends_with(']')) =>
        {
            name
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_answers_to_addresses_loopback_and_its_names_only() {
        let hosts = AgentHosts::new(&["gpumem.monitoring.svc".to_string()]);
        for ok in [
            "10.1.2.3:9417",
            "10.1.2.3",
            "[fd00::17]:9417",
            "[::1]",
            "localhost:9417",
            "LOCALHOST",
            "gpumem.monitoring.svc:9417",
            "GPUMEM.monitoring.svc",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for refused in [
            "",
            "evil.example",
            "evil.example:9417",
            "10.1.2.3.evil.example",
            "1.2.3.4:9417:80",
            "fd00::17",
            "gpumem.monitoring.svc.evil.example",
            "local host",
            "127.0.0.1\u{7f}",
        ] {
            assert!(!hosts.allows(refused), "{refused:?}");
        }
        assert!(!AgentHosts::default().allows("gpumem.monitoring.svc"));
    }
}
