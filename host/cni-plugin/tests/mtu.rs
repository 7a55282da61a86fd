//! The pods' MTU, with the real `wasmplane-cni` binary and namespaces standing in for the
//! node and its pods (root only; skipped loudly otherwise): that of the node's default
//! route's device, detected when the daemon starts; one given instead; the kernel default
//! when the node has no default route; nothing of it when chained.

mod support;

use serde_json::{Value, json};
use support::{Netns, Node, unique};
use wasmplane_cni::PodMtu;

/// The MTU of `dev` in `ns`, as `ip -j link` reports it.
fn mtu_of(ns: &Netns, dev: &str) -> u64 {
    let out = ns.exec(&["ip", "-j", "link", "show", "dev", dev]);
    let links: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
    links[0]["mtu"].as_u64().unwrap_or_else(|| panic!("no mtu in {out}"))
}

/// The MTU of the pod's eth0 and of its node-side end.
fn veth_mtus(node: &Node, pod: &Netns, container: &str) -> (u64, u64) {
    (mtu_of(pod, "eth0"), mtu_of(&node.ns, &wasmplane_cni::host_if_name(container, "eth0")))
}

/// The `mtu` of each interface the ADD result lists (`None` where absent).
fn result_mtus(result: &Value) -> Vec<Option<u64>> {
    let interfaces = result["interfaces"].as_array().unwrap_or_else(|| panic!("no interfaces in {result}"));
    interfaces.iter().map(|i| i.get("mtu").map(|m| m.as_u64().expect("a number"))).collect()
}

/// The pods' MTU in the daemon's state (`GET /v1/allocations`).
fn state_mtu(node: &Node) -> Value {
    let (status, body) = support::http_get(&node.socket(), "/v1/allocations");
    let state: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{status} {body}: {e}"));
    state["mtu"].clone()
}

/// A node namespace like a cloud VM's: its IPv4 default route leaves by the veth `uplink0`
/// with MTU 1400 (metric 100). Decoys a wrong pick would take: a second IPv4 default route
/// by the 9000-MTU `jumbo0` with a higher metric, one in another routing table with a lower
/// metric, and an IPv6 default route by the 1480-MTU `v6up0` (IPv4's comes first).
fn cloud_like(node: &Node) {
    let ns = &node.ns;
    // Veth pairs (the other end left in the node): devices every kernel has.
    for (dev, mtu) in [("uplink", "1400"), ("jumbo", "9000"), ("v6up", "1480")] {
        let (end, peer) = (format!("{dev}0"), format!("{dev}1"));
        ns.exec(&["ip", "link", "add", &end, "mtu", mtu, "type", "veth", "peer", "name", &peer, "mtu", mtu]);
        ns.exec(&["ip", "link", "set", &end, "up"]);
        ns.exec(&["ip", "link", "set", &peer, "up"]);
    }
    ns.exec(&["ip", "addr", "add", "10.244.240.2/24", "dev", "uplink0"]);
    ns.exec(&["ip", "addr", "add", "10.244.241.2/24", "dev", "jumbo0"]);
    ns.exec(&["ip", "-6", "addr", "add", "fd00:10:244:f0::2/64", "dev", "v6up0", "nodad"]);
    ns.exec(&["ip", "route", "add", "default", "via", "10.244.241.1", "dev", "jumbo0", "metric", "200"]);
    ns.exec(&["ip", "route", "add", "default", "via", "10.244.240.1", "dev", "uplink0", "metric", "100"]);
    ns.exec(&["ip", "route", "add", "default", "via", "10.244.241.1", "dev", "jumbo0", "metric", "1", "table", "100"]);
    ns.exec(&["ip", "-6", "route", "add", "default", "via", "fd00:10:244:f0::1", "dev", "v6up0"]);
}

/// Detected: both veth ends get the MTU of the device of the node's lowest-metric IPv4
/// default route (not the jumbo one, not another table's); a 1.1.0 result says so on both
/// interfaces, an older one cannot; the daemon's state shows it. Without an IPv4 default
/// route, the IPv6 one's device, after a restart.
#[test]
fn pods_get_the_mtu_of_the_nodes_default_route() {
    require_root!();
    let mut node = Node::unstarted("10.244.41.0/24");
    cloud_like(&node);
    node.start();
    let daemon = node.daemon.clone().unwrap();
    assert_eq!(daemon.pod_mtu(), Some(&PodMtu::Detected { mtu: 1400, device: "uplink0".into(), ipv6: false }));
    assert_eq!(state_mtu(&node), json!(1400));

    let (a, b) = (Netns::new(unique("-ma")), Netns::new(unique("-mb")));
    node.know_pod("test", "a");
    node.know_pod("test", "b");
    let ra = node.cni_with("ADD", "ctr-a", &a.path(), "a", &node.config("1.1.0"));
    assert!(ra.ok, "{ra:?}");
    assert_eq!(veth_mtus(&node, &a, "ctr-a"), (1400, 1400));
    assert_eq!(result_mtus(&ra.json), [Some(1400), Some(1400)]);
    let rb = node.cni("ADD", "ctr-b", &b.path(), "b");
    assert!(rb.ok, "{rb:?}");
    assert_eq!(veth_mtus(&node, &b, "ctr-b"), (1400, 1400));
    assert_eq!(result_mtus(&rb.json), [None, None], "1.0.0 results have no interface MTU");
    // CHECK of a sized pair passes.
    let mut check = node.config("1.1.0");
    check["prevResult"] = ra.json.clone();
    let r = node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check);
    assert!(r.ok, "{r:?}");
    // A pod end at another MTU than ADD gave it fails CHECK, naming both.
    a.exec(&["ip", "link", "set", "dev", "eth0", "mtu", "1300"]);
    let r = node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check);
    let error = r.json.to_string();
    assert!(!r.ok && error.contains("MTU 1300") && error.contains("1400"), "{r:?}");
    a.exec(&["ip", "link", "set", "dev", "eth0", "mtu", "1400"]);
    assert!(node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check).ok);

    // No IPv4 default route in the main table (another table's does not count): the IPv6
    // one's device, read again at the next start.
    node.ns.exec(&["ip", "route", "del", "default", "via", "10.244.240.1", "dev", "uplink0", "metric", "100"]);
    node.ns.exec(&["ip", "route", "del", "default", "via", "10.244.241.1", "dev", "jumbo0", "metric", "200"]);
    node.restart();
    assert_eq!(
        node.daemon.as_ref().unwrap().pod_mtu(),
        Some(&PodMtu::Detected { mtu: 1480, device: "v6up0".into(), ipv6: true })
    );
    let c = Netns::new(unique("-mc"));
    node.know_pod("test", "c");
    let rc = node.cni("ADD", "ctr-c", &c.path(), "c");
    assert!(rc.ok, "{rc:?}");
    assert_eq!(veth_mtus(&node, &c, "ctr-c"), (1480, 1480));
    assert_eq!(veth_mtus(&node, &a, "ctr-a"), (1400, 1400), "running pods keep theirs");
}

/// Given, the MTU wins over the node's default route; a repeated ADD of a pod made before
/// brings its pair in line. (One that does not suit the pod CIDRs: the unit tests of
/// `lib.rs`.)
#[test]
fn a_given_mtu_wins_over_detection() {
    require_root!();
    let mut node = Node::unstarted("10.244.42.0/24");
    cloud_like(&node);
    node.start();
    let pod = Netns::new(unique("-mg"));
    node.know_pod("test", "g");
    let first = node.cni("ADD", "ctr-g", &pod.path(), "g");
    assert!(first.ok, "{first:?}");
    assert_eq!(veth_mtus(&node, &pod, "ctr-g"), (1400, 1400));

    node.mtu = Some(1300);
    node.restart();
    assert_eq!(node.daemon.as_ref().unwrap().pod_mtu(), Some(&PodMtu::Configured(1300)));
    assert_eq!(state_mtu(&node), json!(1300));
    let other = Netns::new(unique("-mo"));
    node.know_pod("test", "o");
    let r = node.cni_with("ADD", "ctr-o", &other.path(), "o", &node.config("1.1.0"));
    assert!(r.ok, "{r:?}");
    assert_eq!(veth_mtus(&node, &other, "ctr-o"), (1300, 1300));
    assert_eq!(result_mtus(&r.json), [Some(1300), Some(1300)]);
    let again = node.cni("ADD", "ctr-g", &pod.path(), "g");
    assert!(again.ok, "{again:?}");
    assert_eq!(again.ip(), first.ip());
    assert_eq!(veth_mtus(&node, &pod, "ctr-g"), (1300, 1300), "a repeated ADD re-applies the MTU");
}

/// No default route on the node: no MTU set, so the kernel's 1500 on both ends, none in
/// the result, `null` in the state (the daemon warns: the unit tests of `mtu.rs` see it).
#[test]
fn without_a_default_route_pods_get_the_kernel_default() {
    require_root!();
    let node = Node::new("10.244.44.0/24");
    let daemon = node.daemon.clone().unwrap();
    assert_eq!(daemon.pod_mtu(), Some(&PodMtu::KernelDefault("the node has no default route".into())));
    assert_eq!(daemon.mtu(), None);
    assert_eq!(state_mtu(&node), Value::Null);
    let pod = Netns::new(unique("-mk"));
    node.know_pod("test", "k");
    let r = node.cni_with("ADD", "ctr-k", &pod.path(), "k", &node.config("1.1.0"));
    assert!(r.ok, "{r:?}");
    assert_eq!(veth_mtus(&node, &pod, "ctr-k"), (1500, 1500));
    assert_eq!(result_mtus(&r.json), [None, None]);
}

/// Chained, the pods' interfaces are the other plugin's: a given MTU is ignored and none is
/// detected.
#[test]
fn chained_the_mtu_is_left_to_the_other_plugin() {
    require_root!();
    let mut node = Node::new_chained();
    node.mtu = Some(1300);
    node.restart();
    let daemon = node.daemon.clone().unwrap();
    assert_eq!((daemon.pod_mtu(), daemon.mtu()), (None, None));
    assert_eq!(state_mtu(&node), Value::Null);
}
