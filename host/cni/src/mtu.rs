//! The pods' MTU: given, or that of the node's default route's device.
//!
//! A pod left at the kernel's 1500 on a network with a smaller MTU (GCP's 1460, 1450 under
//! many overlays and VPNs) sends frames the network drops without a word (a PMTU black
//! hole), and on a jumbo-frame network (AWS's 9001) wastes throughput. So, as Cilium and
//! Calico do, the pods get the MTU of the interface the node's own traffic leaves by.

use std::fmt;

use ipnet::IpNet;

use crate::error::Error;
use crate::link::RouteDevice;

/// IPv4's minimum: the datagram every host must accept (RFC 791).
const MIN_IPV4: u32 = 576;
/// IPv6's minimum link MTU (RFC 8200).
const MIN_IPV6: u32 = 1280;
/// A veth's maximum (the kernel's `ETH_MAX_MTU`).
const MAX: u32 = 65535;

/// Whether `mtu` suits the pod interfaces of a node with `pod_cidrs`: at least 576, or 1280
/// with an IPv6 pod CIDR, and at most 65535.
pub fn check_mtu(mtu: u32, pod_cidrs: &[IpNet]) -> Result<(), Error> {
    let invalid = |reason: String| Err(Error::InvalidMtu { mtu, reason });
    if mtu > MAX {
        return invalid(format!("a veth takes at most {MAX}"));
    }
    if let Some(cidr) = pod_cidrs.iter().find(|c| c.addr().is_ipv6()) {
        if mtu < MIN_IPV6 {
            return invalid(format!("IPv6 (pod CIDR {cidr}) needs at least {MIN_IPV6}"));
        }
    } else if mtu < MIN_IPV4 {
        return invalid(format!("IPv4 needs at least {MIN_IPV4}"));
    }
    Ok(())
}

/// The MTU the pods' interfaces get, settled when the daemon starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodMtu {
    /// [`crate::DaemonConfig::mtu`], as given.
    Configured(u32),
    /// That of `device`, the node's default route's (IPv4's, or IPv6's without one).
    Detected { mtu: u32, device: String, ipv6: bool },
    /// Left to the kernel (1500 for a veth), for the reason given.
    KernelDefault(String),
}

impl PodMtu {
    /// The MTU set on both veth ends; `None`: the kernel default.
    pub fn mtu(&self) -> Option<u32> {
        match self {
            PodMtu::Configured(mtu) | PodMtu::Detected { mtu, .. } => Some(*mtu),
            PodMtu::KernelDefault(_) => None,
        }
    }

    /// From the device of the node's default route (`None`: it has none). Warns when the
    /// pods are left at the kernel default: their MTU may not be the network's.
    pub(crate) fn detected(device: Option<RouteDevice>, pod_cidrs: &[IpNet]) -> PodMtu {
        let Some(RouteDevice { name, mtu, ipv6 }) = device else {
            tracing::warn!(
                "the node has no default route to take the pods' MTU from: pods get the kernel default (1500); set --cni-mtu if the network's differs"
            );
            return PodMtu::KernelDefault("the node has no default route".into());
        };
        if let Err(e) = check_mtu(mtu, pod_cidrs) {
            tracing::warn!(device = %name, error = %e, "the MTU of the node's default route's device does not suit pods: pods get the kernel default (1500); set --cni-mtu");
            return PodMtu::KernelDefault(format!("{name}'s MTU {mtu} does not suit pods"));
        }
        PodMtu::Detected { mtu, device: name, ipv6 }
    }
}

impl fmt::Display for PodMtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PodMtu::Configured(mtu) => write!(f, "{mtu} (configured)"),
            PodMtu::Detected { mtu, device, ipv6 } => {
                let family = if *ipv6 { 6 } else { 4 };
                write!(f, "{mtu} (detected: {device}, the device of the node's IPv{family} default route)")
            }
            PodMtu::KernelDefault(why) => write!(f, "kernel default ({why})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn cidrs(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn the_mtu_must_carry_the_pods_families() {
        let v4 = cidrs(&["10.244.0.0/24"]);
        let dual = cidrs(&["10.244.0.0/24", "fd00:10:244::/64"]);
        for ok in [576, 1280, 1500, 9001, 65535] {
            assert!(check_mtu(ok, &v4).is_ok(), "{ok}");
        }
        for ok in [1280, 1460, 65535] {
            assert!(check_mtu(ok, &dual).is_ok(), "{ok}");
        }
        let e = check_mtu(575, &v4).unwrap_err();
        assert_eq!(e.code(), crate::code::INVALID_CONFIG);
        assert!(e.to_string().contains("575") && e.to_string().contains("576"), "{e}");
        let e = check_mtu(1279, &dual).unwrap_err();
        assert!(e.to_string().contains("fd00:10:244::/64") && e.to_string().contains("1280"), "{e}");
        assert!(check_mtu(1279, &cidrs(&["fd00:10:244::/64"])).is_err(), "IPv6 only");
        assert!(check_mtu(1279, &v4).is_ok());
        for too_big in [65536, u32::MAX] {
            assert!(check_mtu(too_big, &v4).unwrap_err().to_string().contains("65535"));
        }
        // Chained: no pod CIDRs, the IPv4 rule (the daemon does not check it there at all).
        assert!(check_mtu(576, &[]).is_ok() && check_mtu(500, &[]).is_err());
    }

    /// Records the message and fields of every warning.
    struct Warnings(Arc<Mutex<Vec<String>>>);

    struct Text<'a>(&'a mut String);

    impl tracing::field::Visit for Text<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == tracing::Level::WARN {
                let mut text = String::new();
                event.record(&mut Text(&mut text));
                self.0.lock().unwrap().push(text);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    fn warnings_of<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let out = tracing::subscriber::with_default(Warnings(seen.clone()), f);
        let seen = seen.lock().unwrap().clone();
        (out, seen)
    }

    /// The default route's device gives the MTU; without one, or with an MTU that does not
    /// suit the pods, the kernel default and one warning.
    #[test]
    fn detection_takes_the_default_route_devices_mtu_or_warns() {
        let v4 = cidrs(&["10.244.0.0/24"]);
        let device = |mtu: u32, ipv6: bool| Some(RouteDevice { name: "ens4".into(), mtu, ipv6 });
        let (mtu, warned) = warnings_of(|| PodMtu::detected(device(1460, false), &v4));
        assert_eq!(mtu, PodMtu::Detected { mtu: 1460, device: "ens4".into(), ipv6: false });
        assert_eq!(mtu.mtu(), Some(1460));
        assert!(warned.is_empty(), "{warned:?}");
        assert_eq!(mtu.to_string(), "1460 (detected: ens4, the device of the node's IPv4 default route)");
        assert!(PodMtu::detected(device(9001, true), &v4).to_string().contains("IPv6 default route"));

        let (mtu, warned) = warnings_of(|| PodMtu::detected(None, &v4));
        assert_eq!(mtu.mtu(), None);
        assert_eq!(warned.len(), 1, "{warned:?}");
        assert!(warned[0].contains("no default route") && warned[0].contains("--cni-mtu"), "{warned:?}");
        assert_eq!(mtu.to_string(), "kernel default (the node has no default route)");

        // A default route out of the loopback (MTU 65536), or a link too small for IPv6 pods.
        let dual = cidrs(&["10.244.0.0/24", "fd00:10:244::/64"]);
        for (mtu, pods) in [(65536, &v4), (1000, &dual)] {
            let (got, warned) = warnings_of(|| PodMtu::detected(device(mtu, false), pods));
            assert_eq!(got.mtu(), None, "{mtu}");
            assert_eq!(warned.len(), 1, "{warned:?}");
            assert!(warned[0].contains("ens4") && warned[0].contains(&mtu.to_string()), "{warned:?}");
        }
        assert_eq!(PodMtu::Configured(1300).to_string(), "1300 (configured)");
    }
}
