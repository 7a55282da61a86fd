//! kube-proxy's conntrack settings, applied once at start by a host that writes the kernel:
//! a connection table big enough for the node (raised, never lowered) and TCP timeouts that
//! forget idle established connections after a day instead of five, and half-closed ones
//! after an hour instead of a minute (a service's long-lived idle connections survive). UDP
//! timeouts and TCP's "be liberal" are left as the node has them unless asked for, as
//! kube-proxy leaves them.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// What to set; zero leaves a setting as the node has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConntrackTuning {
    /// Connections tracked per CPU (`--conntrack-max-per-core`).
    pub max_per_core: u64,
    /// The table never gets smaller than this (`--conntrack-min`).
    pub min: u64,
    /// `nf_conntrack_tcp_timeout_established`.
    pub tcp_established_timeout: Duration,
    /// `nf_conntrack_tcp_timeout_close_wait`.
    pub tcp_close_wait_timeout: Duration,
    /// `nf_conntrack_udp_timeout`: a UDP flow that saw packets one way only (a DNS query).
    pub udp_timeout: Duration,
    /// `nf_conntrack_udp_timeout_stream`: a UDP flow that saw replies (QUIC, a VPN).
    pub udp_stream_timeout: Duration,
    /// `nf_conntrack_tcp_be_liberal`: out-of-window TCP packets are not marked INVALID, so a
    /// dataplane that drops INVALID does not reset long connections after a retransmission
    /// storm (kube-proxy's `--conntrack-tcp-be-liberal`). Only ever turned on.
    pub tcp_be_liberal: bool,
}

impl Default for ConntrackTuning {
    /// kube-proxy's defaults.
    fn default() -> Self {
        ConntrackTuning {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: Duration::from_secs(86400),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
            tcp_be_liberal: false,
        }
    }
}

/// One setting the host wrote, left, or could not write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Set {
        sysctl: &'static str,
        from: u64,
        to: u64,
    },
    Kept {
        sysctl: &'static str,
        value: u64,
        why: &'static str,
    },
    /// The kernel refused (or the value could not be read); the node keeps its own.
    Failed {
        sysctl: &'static str,
        error: String,
    },
}

const PROC: &str = "/proc/sys/net/netfilter";
const MAX: &str = "nf_conntrack_max";
const ESTABLISHED: &str = "nf_conntrack_tcp_timeout_established";
const CLOSE_WAIT: &str = "nf_conntrack_tcp_timeout_close_wait";
const UDP: &str = "nf_conntrack_udp_timeout";
const UDP_STREAM: &str = "nf_conntrack_udp_timeout_stream";
const BE_LIBERAL: &str = "nf_conntrack_tcp_be_liberal";

impl ConntrackTuning {
    /// The table size wanted on a node with `cpus` CPUs; `None`: leave it.
    pub fn wanted_max(&self, cpus: u64) -> Option<u64> {
        (self.max_per_core > 0).then(|| (self.max_per_core * cpus).max(self.min))
    }

    /// Applies the settings in network namespace `netns` (`None`: the host's own), each on
    /// its own: one the kernel refuses is reported and the others still go in, as kube-proxy
    /// goes on with the node's settings. The table size belongs to the initial namespace:
    /// from any other it is read-only, and left. Errs only when the namespace cannot be
    /// entered.
    pub fn apply(&self, netns: Option<&Path>, cpus: u64) -> std::io::Result<Vec<Outcome>> {
        let tuning = self.clone();
        crate::dataplane::in_netns(netns, move || {
            let mut outcomes = Vec::new();
            if let Some(wanted) = tuning.wanted_max(cpus) {
                outcomes.push(settle(
                    MAX,
                    |current| {
                        let path = Path::new(PROC).join(MAX);
                        Ok(if current >= wanted {
                            Some("at least the wanted size (never lowered)")
                        } else if read_only(&path)? {
                            Some("read-only here (set from the initial network namespace)")
                        } else {
                            None
                        })
                    },
                    wanted,
                ));
            }
            let timeouts = [
                (ESTABLISHED, tuning.tcp_established_timeout),
                (CLOSE_WAIT, tuning.tcp_close_wait_timeout),
                (UDP, tuning.udp_timeout),
                (UDP_STREAM, tuning.udp_stream_timeout),
            ];
            let wanted = timeouts
                .into_iter()
                .filter(|(_, timeout)| !timeout.is_zero())
                .map(|(sysctl, timeout)| (sysctl, timeout.as_secs()));
            for (sysctl, wanted) in wanted.chain(tuning.tcp_be_liberal.then_some((BE_LIBERAL, 1))) {
                outcomes.push(settle(sysctl, |current| Ok((current == wanted).then_some("already so")), wanted));
            }
            Ok(outcomes)
        })
    }
}

/// Reads `sysctl`, and writes `wanted` unless `keep` (given the current value) says why not.
fn settle(
    sysctl: &'static str,
    keep: impl FnOnce(u64) -> std::io::Result<Option<&'static str>>,
    wanted: u64,
) -> Outcome {
    let path = Path::new(PROC).join(sysctl);
    let attempt = || -> std::io::Result<Outcome> {
        let current = read(&path)?;
        Ok(match keep(current)? {
            Some(why) => Outcome::Kept { sysctl, value: current, why },
            None => {
                write(&path, wanted)?;
                Outcome::Set { sysctl, from: current, to: wanted }
            }
        })
    };
    attempt().unwrap_or_else(|e| Outcome::Failed { sysctl, error: e.to_string() })
}

fn with_path(path: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn read(path: &PathBuf) -> std::io::Result<u64> {
    let text = std::fs::read_to_string(path).map_err(|e| with_path(path, e))?;
    text.trim()
        .parse()
        .map_err(|e| with_path(path, std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{e}"))))
}

fn read_only(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::PermissionsExt as _;
    Ok(std::fs::metadata(path).map_err(|e| with_path(path, e))?.permissions().mode() & 0o200 == 0)
}

fn write(path: &PathBuf, value: u64) -> std::io::Result<()> {
    std::fs::write(path, value.to_string()).map_err(|e| with_path(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_size_follows_the_cpus_above_a_floor() {
        let t = ConntrackTuning::default();
        assert_eq!(t.wanted_max(2), Some(131072), "the floor");
        assert_eq!(t.wanted_max(16), Some(524288));
        assert_eq!(ConntrackTuning { max_per_core: 0, ..t }.wanted_max(16), None, "0 leaves it");
    }

    #[test]
    fn a_setting_that_cannot_be_read_is_reported_not_fatal() {
        let outcome = settle("nf_conntrack_no_such_setting", |_| Ok(None), 1);
        assert!(
            matches!(&outcome, Outcome::Failed { sysctl: "nf_conntrack_no_such_setting", error } if error.contains("nf_conntrack_no_such_setting")),
            "{outcome:?}"
        );
    }
}
