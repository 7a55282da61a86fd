//! The real `wasmplane-cni` binary against the daemon, with namespaces standing in for the
//! node and its pods (root only; skipped loudly otherwise). Addresses: 10.244.x.x only.

mod support;

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use support::{Netns, Node, icmp_echo, run_plugin, tcp_ask, tcp_server, unique};
use wasmplane_cni::AnyPod;

const ECHO: Duration = Duration::from_secs(2);

#[test]
fn add_gives_working_network_and_del_frees_it() {
    require_root!();
    let node = Node::new("10.244.11.0/24");
    let (a, b) = (Netns::new(unique("-a")), Netns::new(unique("-b")));
    node.know_pod("test", "a");
    node.know_pod("test", "b");

    let ra = node.cni("ADD", "ctr-a", &a.path(), "a");
    assert!(ra.ok, "{ra:?}");
    let rb = node.cni("ADD", "ctr-b", &b.path(), "b");
    assert!(rb.ok, "{rb:?}");
    let (ip_a, ip_b) = (ra.ip(), rb.ip());
    assert_ne!(ip_a, ip_b);
    for ip in [ip_a, ip_b] {
        assert!(
            node.cidrs[0].contains(&IpAddr::V4(ip)) && ip != Ipv4Addr::new(10, 244, 11, 1),
            "{ip} not a pod address of {}",
            node.cidrs[0]
        );
    }
    // The spec's result: version, both interfaces with the sandbox on the pod side, the IP
    // pointing at that interface with the gateway, and a default route.
    let r = &ra.json;
    assert_eq!(r["cniVersion"], "1.0.0");
    assert_eq!(r["interfaces"][1]["name"], "eth0");
    assert_eq!(r["interfaces"][1]["sandbox"], a.path());
    assert_eq!(r["interfaces"][0]["name"], wasmplane_cni::host_if_name("ctr-a", "eth0"));
    assert_eq!(r["ips"][0]["interface"], 1);
    assert_eq!(r["ips"][0]["gateway"], "10.244.11.1");
    assert!(
        r["routes"].as_array().unwrap().iter().any(|rt| rt["dst"] == "0.0.0.0/0" && rt["gw"] == "10.244.11.1"),
        "{r}"
    );
    assert!(r["interfaces"][1]["mac"].as_str().unwrap().len() == 17);
    // The pod's address reached the host's model at once.
    assert_eq!(node.sink.get("test", "a"), Some(vec![ip_a.into()]));
    // The daemon's own view, over its socket.
    let (status, body) = support::http_get(&node.socket(), "/healthz");
    assert!(status.contains("200") && body == "ok", "{status} {body}");
    let (status, body) = support::http_get(&node.socket(), "/v1/allocations");
    let allocs: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{status} {body}: {e}"));
    assert_eq!(allocs["pools"], json!([{"podCIDR": "10.244.11.0/24", "gateway": "10.244.11.1"}]));
    let listed: HashSet<String> = allocs["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| format!("{} {}", a["containerId"].as_str().unwrap(), a["ip"].as_str().unwrap()))
        .collect();
    assert_eq!(listed, HashSet::from([format!("ctr-a {ip_a}"), format!("ctr-b {ip_b}")]));
    // The kernel agrees.
    assert!(a.exec(&["ip", "-o", "addr", "show", "dev", "eth0"]).contains(&format!("{ip_a}/32")));

    // Traffic: node -> pod (ICMP, TCP), pod -> pod (ICMP, TCP), pod -> gateway.
    let node_path = node.ns.path();
    assert!(icmp_echo(&node_path, ip_a, ECHO), "node cannot ping pod a {ip_a}");
    assert!(icmp_echo(&a.path(), ip_b, ECHO), "pod a cannot ping pod b {ip_b}");
    assert!(icmp_echo(&b.path(), Ipv4Addr::new(10, 244, 11, 1), ECHO), "pod b cannot ping its gateway");
    let server = tcp_server(&b.path(), 8080, "b");
    assert_eq!(tcp_ask(&node_path, SocketAddr::from((ip_b, 8080))).unwrap(), "b saw 10.244.11.1");
    assert_eq!(tcp_ask(&a.path(), SocketAddr::from((ip_b, 8080))).unwrap(), format!("b saw {ip_a}"));
    drop(server);

    // DEL removes both ends and the address; a new pod does not get the address at once,
    // but it is free (not in the allocations any more).
    let host_if = wasmplane_cni::host_if_name("ctr-a", "eth0");
    let del = node.cni("DEL", "ctr-a", &a.path(), "a");
    assert!(del.ok && del.json.is_null(), "{del:?}");
    assert!(!node.ns.try_exec(&["ip", "link", "show", &host_if]), "{host_if} still on the node");
    assert!(!a.try_exec(&["ip", "link", "show", "eth0"]), "eth0 still in pod a");
    assert!(!icmp_echo(&node_path, ip_a, Duration::from_millis(300)), "{ip_a} still answers");
    let daemon = node.daemon.as_ref().unwrap();
    assert!(daemon.ipam().unwrap().all().iter().all(|x| x.ips != [IpAddr::V4(ip_a)]), "{ip_a} still allocated");
    assert_eq!(node.sink.get("test", "a"), None);
    assert!(node.sink.get("test", "b").is_some());
    // DEL again, and DEL with the namespace gone: both fine (idempotent).
    assert!(node.cni("DEL", "ctr-a", &a.path(), "a").ok);
    let b_path = b.path();
    drop(b);
    let del_b = node.cni("DEL", "ctr-b", &b_path, "b");
    assert!(del_b.ok, "{del_b:?}");
    assert!(daemon.ipam().unwrap().all().is_empty(), "{:?}", daemon.ipam().unwrap().all());
    assert!(node.host_links().is_empty(), "{:?}", node.host_links());
}

#[test]
fn repeated_add_is_idempotent_and_check_detects_a_deleted_interface() {
    require_root!();
    let node = Node::new("10.244.12.0/24");
    let pod = Netns::new(unique("-p"));
    node.know_pod("test", "p");

    let first = node.cni("ADD", "ctr", &pod.path(), "p");
    assert!(first.ok, "{first:?}");
    // The runtime must not repeat ADD without DEL; if it does, it gets the same answer and
    // nothing is allocated or created twice.
    let second = node.cni("ADD", "ctr", &pod.path(), "p");
    assert!(second.ok, "{second:?}");
    assert_eq!(second.ip(), first.ip());
    assert_eq!(second.json["interfaces"][1]["mac"], first.json["interfaces"][1]["mac"]);
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().all().len(), 1);
    assert_eq!(node.host_links().len(), 1);

    let check = node.cni_with("CHECK", "ctr", &pod.path(), "p", &{
        let mut c = node.config("1.0.0");
        c["prevResult"] = first.json.clone();
        c
    });
    assert!(check.ok && check.json.is_null(), "{check:?}");

    // Someone deletes the pod's interface: CHECK says so, with our code and a readable text.
    pod.exec(&["ip", "link", "del", "eth0"]);
    let check = node.cni("CHECK", "ctr", &pod.path(), "p");
    assert!(!check.ok);
    assert_eq!(check.code(), 105, "{check:?}");
    let details = check.json["details"].as_str().unwrap();
    assert!(details.contains("missing"), "{details}");
    assert_eq!(check.json["cniVersion"], "1.0.0");

    // The address is still the container's (only DEL frees it), and ADD repairs.
    let again = node.cni("ADD", "ctr", &pod.path(), "p");
    assert!(again.ok, "{again:?}");
    assert_eq!(again.ip(), first.ip());
    assert!(node.cni("CHECK", "ctr", &pod.path(), "p").ok);
    assert!(icmp_echo(&node.ns.path(), again.ip(), ECHO));

    // A route removed behind our back is caught too.
    pod.exec(&["ip", "route", "del", "default"]);
    let check = node.cni("CHECK", "ctr", &pod.path(), "p");
    assert_eq!(check.code(), 105, "{check:?}");
    assert!(check.json["details"].as_str().unwrap().contains("default route"), "{check:?}");

    // CHECK of a container never added.
    let unknown = node.cni("CHECK", "nope", &pod.path(), "p");
    assert_eq!(unknown.code(), 106, "{unknown:?}");
}

#[test]
fn restart_keeps_allocations() {
    require_root!();
    let mut node = Node::new("10.244.13.0/24");
    let pods: Vec<Netns> = (0..3).map(|i| Netns::new(unique(&format!("-r{i}")))).collect();
    for i in 0..3 {
        node.know_pod("test", &format!("r{i}"));
    }
    let a = node.cni("ADD", "ctr-0", &pods[0].path(), "r0");
    let b = node.cni("ADD", "ctr-1", &pods[1].path(), "r1");
    assert!(a.ok && b.ok, "{a:?} {b:?}");

    node.restart();
    let daemon = node.daemon.as_ref().unwrap();
    let recovered: HashSet<IpAddr> = daemon.ipam().unwrap().all().iter().map(|x| x.ips[0]).collect();
    assert_eq!(recovered, HashSet::from([a.ip().into(), b.ip().into()]));

    // A new container after the restart gets a different address; the old ones still check.
    let c = node.cni("ADD", "ctr-2", &pods[2].path(), "r2");
    assert!(c.ok, "{c:?}");
    assert!(c.ip() != a.ip() && c.ip() != b.ip(), "{} handed out twice", c.ip());
    assert!(node.cni("CHECK", "ctr-0", &pods[0].path(), "r0").ok);
    // A repeated ADD after the restart still returns the recovered address.
    assert_eq!(node.cni("ADD", "ctr-1", &pods[1].path(), "r1").ip(), b.ip());
    // DEL after the restart frees the recovered address.
    assert!(node.cni("DEL", "ctr-0", &pods[0].path(), "r0").ok);
    node.restart();
    let left: HashSet<IpAddr> = node.daemon.as_ref().unwrap().ipam().unwrap().all().iter().map(|x| x.ips[0]).collect();
    assert_eq!(left, HashSet::from([b.ip().into(), c.ip().into()]));
    assert!(icmp_echo(&node.ns.path(), c.ip(), ECHO));

    // A pod whose namespace went away while the daemon was down (no DEL came): its veth
    // went with it, so the restart releases its address; the live ones stay.
    node.stop();
    let mut pods = pods;
    drop(pods.remove(1)); // ctr-1's namespace
    // The kernel dismantles a namespace (and its veth pair) asynchronously, in a work queue
    // shared with every other test's namespaces: seconds on a loaded machine.
    let gone = wasmplane_cni::host_if_name("ctr-1", "eth0");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while node.host_links().contains(&gone) {
        assert!(std::time::Instant::now() < deadline, "{gone} outlived its namespace");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(node.sink.get("test", "r1").is_some());
    node.start();
    let left: HashSet<IpAddr> = node.daemon.as_ref().unwrap().ipam().unwrap().all().iter().map(|x| x.ips[0]).collect();
    assert_eq!(left, HashSet::from([c.ip().into()]));
    assert_eq!(node.sink.get("test", "r1"), None, "the host's model is told too");
    assert!(node.cni("CHECK", "ctr-2", &pods[1].path(), "r2").ok);
}

#[test]
fn add_waits_for_the_pod_cache_then_asks_to_try_again() {
    require_root!();
    let mut node = Node::new("10.244.14.0/24");
    node.wait = Duration::from_millis(300);
    node.restart();
    let pod = Netns::new(unique("-w"));

    // Never known: code 11 after the bounded wait, nothing allocated or created.
    let r = node.cni("ADD", "ctr", &pod.path(), "late");
    assert!(!r.ok);
    assert_eq!(r.code(), 11, "{r:?}");
    assert!(r.json["details"].as_str().unwrap().contains("test/late"), "{r:?}");
    assert!(r.elapsed >= Duration::from_millis(300), "{:?}", r.elapsed);
    assert!(node.daemon.as_ref().unwrap().ipam().unwrap().all().is_empty());
    assert!(node.host_links().is_empty());

    // Known while ADD waits: ADD goes on as soon as the watch delivers it (well before the
    // wait's end; the wait is long so a loaded machine cannot blur the two).
    node.wait = Duration::from_secs(30);
    node.restart();
    let cache = node.pods.clone();
    let feeder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        cache.insert(wasmplane_cni::PodInfo {
            namespace: "test".into(),
            name: "late".into(),
            uid: Some("uid-1".into()),
        });
    });
    let r = node.cni("ADD", "ctr", &pod.path(), "late");
    feeder.join().unwrap();
    assert!(r.ok, "{r:?}");
    assert!(r.elapsed >= Duration::from_millis(400) && r.elapsed < Duration::from_secs(20), "{:?}", r.elapsed);
}

#[test]
fn hundred_concurrent_adds_get_distinct_addresses() {
    require_root!();
    let mut node = Node::new("10.244.15.0/24");
    node.stop();
    node.start_with(Arc::new(AnyPod));
    let pods: Vec<Netns> = (0..100).map(|i| Netns::new(unique(&format!("-c{i}")))).collect();
    let replies: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let node = &node;
                s.spawn(move || node.cni("ADD", &format!("ctr-{i}"), &p.path(), &format!("c{i}")))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let failed: Vec<_> = replies.iter().filter(|r| !r.ok).collect();
    assert!(failed.is_empty(), "{} failed, first: {:?}", failed.len(), failed.first());
    let ips: HashSet<Ipv4Addr> = replies.iter().map(|r| r.ip()).collect();
    assert_eq!(ips.len(), 100, "addresses handed out twice");
    assert_eq!(node.host_links().len(), 100);
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().all().len(), 100);
    // Spot-check that the last one is reachable.
    assert!(icmp_echo(&node.ns.path(), replies[99].ip(), ECHO));
}

#[test]
fn errors_carry_cni_codes_and_versions() {
    require_root!();
    let node = Node::new("10.244.16.0/24");
    let pod = Netns::new(unique("-e"));
    node.know_pod("test", "e");
    let cfg = node.config("1.0.0");

    let version = run_plugin(support::PLUGIN, &[("CNI_COMMAND", "VERSION")], &cfg, None);
    assert!(version.ok);
    let supported = version.json["supportedVersions"].as_array().unwrap();
    assert!(supported.contains(&json!("1.0.0")) && supported.contains(&json!("0.4.0")), "{version:?}");

    // Missing CNI_IFNAME: 4, naming the variable.
    let r = run_plugin(
        support::PLUGIN,
        &[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "x"), ("CNI_NETNS", &pod.path())],
        &cfg,
        None,
    );
    assert_eq!(r.code(), 4, "{r:?}");
    assert!(r.json["details"].as_str().unwrap().contains("CNI_IFNAME"));
    // Unknown version: 1. Bad JSON: 6 (sent as a JSON string, which is not an object: 7
    // from the plugin's cniVersion check).
    assert_eq!(
        node.cni_with(
            "ADD",
            "x",
            &pod.path(),
            "e",
            &json!({"cniVersion": "9.9.9", "name": "n", "daemonSocket": node.socket()})
        )
        .code(),
        1
    );
    assert_eq!(node.cni_with("ADD", "x", &pod.path(), "e", &json!("not a config")).code(), 7);
    // Missing name: the daemon's validation (7), in the config's version.
    let r = node.cni_with("ADD", "x", &pod.path(), "e", &json!({"cniVersion": "0.4.0", "daemonSocket": node.socket()}));
    assert_eq!((r.code(), r.json["cniVersion"].as_str()), (7, Some("0.4.0")), "{r:?}");
    // Pod namespace that does not exist: ours (102), and nothing stays allocated.
    let r = node.cni("ADD", "x", "/var/run/netns/wpcni-does-not-exist", "e");
    assert_eq!(r.code(), 102, "{r:?}");
    assert!(node.daemon.as_ref().unwrap().ipam().unwrap().all().is_empty());
    // Daemon not there: 11 (try again later), with the socket named.
    let r = node.cni_with(
        "ADD",
        "x",
        &pod.path(),
        "e",
        &json!({"cniVersion": "1.0.0", "name": "n", "daemonSocket": "/nonexistent/cni.sock"}),
    );
    assert_eq!(r.code(), 11, "{r:?}");
    assert!(r.json["msg"].as_str().unwrap().contains("/nonexistent/cni.sock"));

    // A 0.4.0 configuration gets a 0.4.0 result (with the per-IP version field).
    let r = node.cni_with("ADD", "v4", &pod.path(), "e", &node.config("0.4.0"));
    assert!(r.ok, "{r:?}");
    assert_eq!(r.json["cniVersion"], "0.4.0");
    assert_eq!(r.json["ips"][0]["version"], "4");
    // The same container ID again on an interface that is taken by it: handled (same IP).
    assert_eq!(node.cni_with("ADD", "v4", &pod.path(), "e", &node.config("0.4.0")).ip(), r.ip());
    // Another container asking for the same interface name in that namespace: refused.
    let clash = node.cni("ADD", "other", &pod.path(), "e");
    assert_eq!(clash.code(), 104, "{clash:?}");
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().all().len(), 1, "the refused ADD released its address");
}

/// CNI 1.1.0: STATUS says whether an ADD can be served; GC releases the addresses and
/// interfaces of the attachments the runtime no longer lists, and spares young ones.
#[test]
fn status_and_gc_of_spec_1_1() {
    require_root!();
    let mut node = Node::new("10.244.17.0/24");
    let cfg = node.config("1.1.0");
    let version = run_plugin(support::PLUGIN, &[("CNI_COMMAND", "VERSION")], &cfg, None);
    assert!(version.json["supportedVersions"].as_array().unwrap().contains(&json!("1.1.0")), "{version:?}");

    // STATUS: no output when ready; older configurations do not have it; no daemon: 50.
    let status = node.network("STATUS", &cfg);
    assert!(status.ok && status.json.is_null(), "{status:?}");
    assert_eq!(node.network("STATUS", &node.config("1.0.0")).code(), 1);
    let mut elsewhere = cfg.clone();
    elsewhere["daemonSocket"] = json!("/nonexistent/cni.sock");
    assert_eq!(node.network("STATUS", &elsewhere).code(), 50);

    let pods: Vec<Netns> = (0..3).map(|i| Netns::new(unique(&format!("-g{i}")))).collect();
    let mut ips = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        node.know_pod("test", &format!("g{i}"));
        let r = node.cni_with("ADD", &format!("ctr-g{i}"), &pod.path(), &format!("g{i}"), &cfg);
        assert!(r.ok, "{r:?}");
        assert_eq!(r.json["cniVersion"], "1.1.0");
        ips.push(r.ip());
    }

    // GC: the runtime still has g0 (and lists one the daemon never saw); g1 and g2 go.
    let mut gc = cfg.clone();
    gc["cni.dev/valid-attachments"] =
        json!([{"containerID": "ctr-g0", "ifname": "eth0"}, {"containerID": "ghost", "ifname": "eth0"}]);
    let r = node.network("GC", &gc);
    assert!(r.ok && r.json.is_null(), "{r:?}");
    let daemon = node.daemon.clone().unwrap();
    let left: Vec<String> = daemon.ipam().unwrap().all().into_iter().map(|a| a.container_id).collect();
    assert_eq!(left, ["ctr-g0"]);
    assert_eq!(node.host_links(), [wasmplane_cni::host_if_name("ctr-g0", "eth0")]);
    assert_eq!(node.sink.get("test", "g1"), None, "a released address leaves the model");
    assert_eq!(node.sink.get("test", "g0"), Some(vec![ips[0].into()]));
    assert!(icmp_echo(&node.ns.path(), ips[0], ECHO), "the valid attachment still works");
    // Without the runtime's list nothing is known to be valid: refused, nothing released.
    assert_eq!(node.network("GC", &cfg).code(), 7);
    assert_eq!(daemon.ipam().unwrap().all().len(), 1);

    // With a grace period, an attachment younger than it is spared even when not listed
    // (the runtime's list may predate its ADD).
    node.gc_grace = Duration::from_secs(3600);
    node.restart();
    let r = node.cni_with("ADD", "ctr-g1", &pods[1].path(), "g1", &cfg);
    assert!(r.ok, "{r:?}");
    gc["cni.dev/valid-attachments"] = json!([]);
    let r = node.network("GC", &gc);
    assert!(r.ok, "{r:?}");
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().all().len(), 2, "young attachments are spared");
}

/// A dual-stack node (IPv6 primary, as a cluster may be): every pod gets one address of
/// each family, both work at once (no duplicate address detection to wait out) for traffic
/// from the node, between pods (IPv6 forwarding turned on by the daemon) and to the
/// gateway; CHECK looks at both; a restart recovers both; DEL frees both. An IPv6-only
/// node works alone.
#[test]
fn dual_stack_pods_get_an_address_of_each_family() {
    require_root!();
    let mut node = Node::new("fd00:10:244:18::/64,10.244.18.0/24");
    let forwarding6 = |node: &Node| node.ns.exec(&["sysctl", "-n", "net.ipv6.conf.all.forwarding"]).trim().to_string();
    assert_eq!(forwarding6(&node), "1", "the daemon turns IPv6 forwarding on");
    let (a, b) = (Netns::new(unique("-a")), Netns::new(unique("-b")));
    node.know_pod("test", "a");
    node.know_pod("test", "b");
    let ra = node.cni("ADD", "ctr-a", &a.path(), "a");
    assert!(ra.ok, "{ra:?}");
    let rb = node.cni("ADD", "ctr-b", &b.path(), "b");
    assert!(rb.ok, "{rb:?}");
    let (ips_a, ips_b) = (ra.ips(), rb.ips());
    let gw6: IpAddr = "fd00:10:244:18::1".parse().unwrap();
    for ips in [&ips_a, &ips_b] {
        assert!(ips.len() == 2 && ips[0].is_ipv6() && ips[1].is_ipv4(), "primary family first: {ips:?}");
        assert!(node.cidrs[0].contains(&ips[0]) && ips[0] != gw6, "{ips:?}");
        assert!(node.cidrs[1].contains(&ips[1]), "{ips:?}");
    }
    let r = &ra.json;
    assert_eq!(r["ips"][0]["address"], format!("{}/128", ips_a[0]));
    assert_eq!(
        (r["ips"][0]["gateway"].as_str(), r["ips"][1]["gateway"].as_str()),
        (Some("fd00:10:244:18::1"), Some("10.244.18.1"))
    );
    let routes = r["routes"].as_array().unwrap();
    assert!(routes.iter().any(|rt| rt["dst"] == "::/0" && rt["gw"] == "fd00:10:244:18::1"), "{r}");
    assert!(routes.iter().any(|rt| rt["dst"] == "0.0.0.0/0" && rt["gw"] == "10.244.18.1"), "{r}");
    assert_eq!(node.sink.get("test", "a"), Some(ips_a.clone()), "both addresses reach the model");
    let pod_addrs = a.exec(&["ip", "-6", "-o", "addr", "show", "dev", "eth0"]);
    let ours = pod_addrs.lines().find(|l| l.contains(&format!("{}/128", ips_a[0])));
    assert!(ours.is_some_and(|l| !l.contains("tentative")), "usable at once: {pod_addrs}");

    // IPv6 traffic: node -> pod, pod -> pod (forwarded by the node), pod -> gateway; IPv4 too.
    let server_b = support::tcp_server_on(&b.path(), SocketAddr::new(IpAddr::from([0u16; 8]), 8086), "b");
    assert_eq!(tcp_ask(&node.ns.path(), SocketAddr::new(ips_b[0], 8086)).unwrap(), format!("b saw {gw6}"));
    assert_eq!(tcp_ask(&a.path(), SocketAddr::new(ips_b[0], 8086)).unwrap(), format!("b saw {}", ips_a[0]));
    drop(server_b);
    let server_node = support::tcp_server_on(&node.ns.path(), SocketAddr::new(IpAddr::from([0u16; 8]), 8087), "node");
    assert_eq!(tcp_ask(&b.path(), SocketAddr::new(gw6, 8087)).unwrap(), format!("node saw {}", ips_b[0]));
    drop(server_node);
    let IpAddr::V4(b4) = ips_b[1] else { unreachable!() };
    assert!(icmp_echo(&a.path(), b4, ECHO), "IPv4 beside IPv6: pod a cannot ping pod b {b4}");

    // CHECK covers both families: the ADD's own result passes, one lacking the IPv6
    // address does not, nor does a pod whose IPv6 default route went.
    let mut check = node.config("1.0.0");
    check["prevResult"] = ra.json.clone();
    assert!(node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check).ok);
    let mut v4_only = check.clone();
    v4_only["prevResult"]["ips"] = json!([ra.json["ips"][1]]);
    let r = node.cni_with("CHECK", "ctr-a", &a.path(), "a", &v4_only);
    assert!(!r.ok && r.code() == 105 && r.json["details"].as_str().unwrap().contains(&ips_a[0].to_string()), "{r:?}");
    a.exec(&["ip", "-6", "route", "del", "default"]);
    let r = node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check);
    assert!(!r.ok && r.code() == 105 && r.json["details"].as_str().unwrap().contains("default route"), "{r:?}");
    // A repeated ADD repairs it, with the same addresses.
    let again = node.cni("ADD", "ctr-a", &a.path(), "a");
    assert_eq!(again.ips(), ips_a);
    assert!(node.cni_with("CHECK", "ctr-a", &a.path(), "a", &check).ok);

    // A restart recovers both families' addresses; DEL frees both.
    node.restart();
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().get("ctr-b", "eth0").map(|x| x.ips), Some(ips_b.clone()));
    assert!(node.cni("DEL", "ctr-b", &b.path(), "b").ok);
    assert_eq!(node.sink.get("test", "b"), None);
    assert!(tcp_ask(&node.ns.path(), SocketAddr::new(ips_b[0], 8086)).is_err(), "{} still answers", ips_b[0]);
    let left: Vec<Vec<IpAddr>> =
        node.daemon.as_ref().unwrap().ipam().unwrap().all().into_iter().map(|x| x.ips).collect();
    assert_eq!(left, [ips_a]);

    // IPv6 only.
    let node6 = Node::new("fd00:10:244:19::/64");
    let c = Netns::new(unique("-c"));
    node6.know_pod("test", "c");
    let rc = node6.cni("ADD", "ctr-c", &c.path(), "c");
    assert!(rc.ok, "{rc:?}");
    let ips_c = rc.ips();
    assert!(ips_c.len() == 1 && node6.cidrs[0].contains(&ips_c[0]), "{ips_c:?}");
    let server_c = support::tcp_server_on(&c.path(), SocketAddr::new(IpAddr::from([0u16; 8]), 8086), "c");
    assert_eq!(tcp_ask(&node6.ns.path(), SocketAddr::new(ips_c[0], 8086)).unwrap(), "c saw fd00:10:244:19::1");
    drop(server_c);
}

/// Chained after another plugin (Cilium's generic-veth chaining), with the real plugin
/// binary: ADD hands back the other plugin's result in the request's version and puts the
/// pod's addresses in the model at once, creating, allocating and turning on nothing; ADD
/// with no addresses before it is refused; CHECK and STATUS pass; DEL takes the addresses
/// out of the model, with or without the cached result (again: fine), and leaves the other
/// plugin's interface alone; GC takes out those of an attachment the runtime no longer lists.
#[test]
fn chained_daemon_follows_the_previous_plugin_and_touches_nothing() {
    require_root!();
    let node = Node::new_chained();
    let pod = Netns::new(unique("-ch"));
    node.know_pod("test", "ch");
    // The other plugin's work: a veth pair into the pod, the pod's end with its address.
    node.ns.exec(&["ip", "link", "add", "vethch0", "type", "veth", "peer", "name", "eth0", "netns", &pod.name]);
    pod.exec(&["ip", "addr", "add", "10.244.31.5/24", "dev", "eth0"]);
    let links = |node: &Node, pod: &Netns| (node.ns.links(), pod.links());
    let before = links(&node, &pod);
    let prev = json!({
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "mac": "02:42:0a:f4:1f:05", "sandbox": pod.path()}],
        "ips": [
            {"address": "10.244.31.5/24", "gateway": "10.244.31.1", "interface": 0},
            {"address": "fd00:10:244:31::5/64", "gateway": "fd00:10:244:31::1", "interface": 0},
        ],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.31.1"}],
        "dns": {},
    });
    let mut chained = node.config("1.1.0");
    chained["prevResult"] = prev.clone();

    let add = node.cni_with("ADD", "ctr-ch", &pod.path(), "ch", &chained);
    assert!(add.ok, "{add:?}");
    let mut want = prev.clone();
    want["cniVersion"] = json!("1.1.0");
    assert_eq!(add.json, want, "the previous result, in the request's version");
    let ips: Vec<IpAddr> = vec!["10.244.31.5".parse().unwrap(), "fd00:10:244:31::5".parse().unwrap()];
    assert_eq!(node.sink.get("test", "ch"), Some(ips.clone()), "the addresses reach the model at once");
    assert_eq!(links(&node, &pod), before, "no interface created on the node or in the pod");
    let (status, body) = support::http_get(&node.socket(), "/v1/allocations");
    let allocs: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{status} {body}: {e}"));
    assert_eq!(
        (&allocs["pools"], &allocs["allocations"], &allocs["chained"]),
        (&json!([]), &json!([]), &json!(true)),
        "nothing allocated: {allocs}"
    );
    let recorded = &allocs["chainedAttachments"];
    assert_eq!(
        (recorded[0]["containerId"].as_str(), recorded.as_array().map(Vec::len)),
        (Some("ctr-ch"), Some(1)),
        "{allocs}"
    );
    for forwarding in ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"] {
        assert_eq!(
            node.ns.exec(&["sysctl", "-n", forwarding]).trim(),
            "0",
            "{forwarding}: the primary plugin's to turn on"
        );
    }

    // Not after an address-giving plugin: refused with the configuration code and why.
    let alone = node.cni_with("ADD", "ctr-alone", &pod.path(), "ch", &node.config("1.1.0"));
    assert!(!alone.ok);
    assert_eq!((alone.code(), alone.json["cniVersion"].as_str()), (7, Some("1.1.0")), "{alone:?}");
    let details = alone.json["details"].as_str().unwrap();
    assert!(
        details.contains("chained") && details.contains("must come after") && details.contains("prevResult"),
        "{details}"
    );
    assert!(alone.json["msg"].as_str().unwrap().contains("chained"), "{alone:?}");
    let mut empty = chained.clone();
    empty["prevResult"]["ips"] = json!([]);
    let r = node.cni_with("ADD", "ctr-alone", &pod.path(), "ch", &empty);
    assert_eq!(r.code(), 7, "{r:?}");
    assert!(r.json["details"].as_str().unwrap().contains("no address"), "{r:?}");
    assert_eq!(node.sink.get("test", "ch"), Some(ips.clone()), "a refused ADD changes nothing");

    // CHECK: nothing of ours to check while the pod has addresses; STATUS and GC.
    let check = node.cni_with("CHECK", "ctr-ch", &pod.path(), "ch", &chained);
    assert!(check.ok && check.json.is_null(), "{check:?}");
    assert_eq!(node.cni_with("CHECK", "ctr-ch", &pod.path(), "ch", &node.config("1.1.0")).code(), 7);
    let status = node.network("STATUS", &node.config("1.1.0"));
    assert!(status.ok && status.json.is_null(), "{status:?}");
    let mut gc = node.config("1.1.0");
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "ctr-ch", "ifname": "eth0"}]);
    let r = node.network("GC", &gc);
    assert!(r.ok, "{r:?}");
    assert_eq!(node.sink.get("test", "ch"), Some(ips.clone()), "GC keeps what the runtime lists");

    // DEL without the cached result: the addresses ADD reported leave the model, the other
    // plugin's interface stays. With it, again: still fine.
    let del = node.cni_with("DEL", "ctr-ch", &pod.path(), "ch", &node.config("1.1.0"));
    assert!(del.ok, "{del:?}");
    assert_eq!(node.sink.get("test", "ch"), None);
    for _ in 0..2 {
        let del = node.cni_with("DEL", "ctr-ch", &pod.path(), "ch", &chained);
        assert!(del.ok && del.json.is_null(), "{del:?}");
        assert_eq!(node.sink.get("test", "ch"), None);
    }
    assert_eq!(links(&node, &pod), before, "DEL removes no interface");

    // Added again, and its DEL lost: GC takes the addresses out once the runtime no longer
    // lists the attachment (no grace period here), and still touches no interface.
    let add = node.cni_with("ADD", "ctr-ch2", &pod.path(), "ch", &chained);
    assert!(add.ok, "{add:?}");
    assert_eq!(node.sink.get("test", "ch"), Some(ips));
    gc["cni.dev/valid-attachments"] = json!([]);
    let r = node.network("GC", &gc);
    assert!(r.ok, "{r:?}");
    assert_eq!(node.sink.get("test", "ch"), None, "GC takes out what the runtime no longer lists");
    assert_eq!(links(&node, &pod), before, "GC removes no interface");
    assert!(pod.exec(&["ip", "-o", "addr", "show", "dev", "eth0"]).contains("10.244.31.5/24"));
}

/// Not chained, a `prevResult` from a plugin before wasmplane changes nothing: the address is
/// allocated from the node's pod CIDR and the veth created, as always.
#[test]
fn primary_daemon_allocates_whatever_the_prev_result() {
    require_root!();
    let node = Node::new("10.244.32.0/24");
    let pod = Netns::new(unique("-pr"));
    node.know_pod("test", "pr");
    let mut cfg = node.config("1.0.0");
    cfg["prevResult"] = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.244.99.5/24"}]});
    let add = node.cni_with("ADD", "ctr-pr", &pod.path(), "pr", &cfg);
    assert!(add.ok, "{add:?}");
    let ip = IpAddr::V4(add.ip());
    assert!(node.cidrs[0].contains(&ip), "{ip} not from 10.244.32.0/24");
    assert_eq!(node.sink.get("test", "pr"), Some(vec![ip]));
    assert_eq!(node.daemon.as_ref().unwrap().ipam().unwrap().all().len(), 1);
    assert_eq!(node.host_links(), [wasmplane_cni::host_if_name("ctr-pr", "eth0")]);
}
