use super::*;
use wasmplane_runtime::wit::*;

/// Services' rules with pod traffic detected by source address, the default, on a
/// dual-stack node (a detector in each family).
fn validate_service_output(key: &ObjectKey, out: &Ruleset) -> Result<ObjectRules, InvalidOutput> {
    super::validate_service_output(key, out, PodDetection::new(&PodTraffic::default(), &dual_stack()))
}

/// Cluster CIDRs of both families.
fn dual_stack() -> Vec<IpNet> {
    vec!["10.244.0.0/16".parse().unwrap(), "fd00:10::/48".parse().unwrap()]
}

fn key() -> ObjectKey {
    ObjectKey::new("shop", "web")
}

fn ruleset(chains: Vec<Chain>, elements: Vec<MapElement>) -> Ruleset {
    Ruleset { chains, sets: vec![], map_elements: elements, warnings: vec![] }
}

fn dnat_chain(name: &str, addr: &str) -> Chain {
    Chain {
        name: name.into(),
        rules: vec![Rule {
            matches: vec![RuleMatch::Protocol(Protocol::Tcp)],
            statements: vec![RuleStatement::Dnat(DnatTarget { address: addr.into(), port: 8080 })],
            verdict: Verdict::None,
            comment: None,
        }],
    }
}

fn element(map: &str, ip: &str, verdict: Verdict) -> MapElement {
    MapElement {
        map_name: map.into(),
        key: vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)],
        verdict,
    }
}

#[test]
fn renders_valid_output() {
    let out = ruleset(
        vec![dnat_chain("svc/shop/web/tcp/http", "10.244.0.11")],
        vec![element("service-ips", "10.96.0.20", Verdict::Goto("svc/shop/web/tcp/http".into()))],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    assert_eq!(rules.chains["svc/shop/web/tcp/http"], vec!["meta l4proto tcp dnat ip to 10.244.0.11:8080".to_string()]);
    assert_eq!(rules.elements[&("service-ips".into(), "10.96.0.20 . tcp . 80".into())], "goto svc/shop/web/tcp/http");
    let text = full_transaction([&rules].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    assert!(
        text.contains(
            "add element inet wasmplane-s0 service-ips { 10.96.0.20 . tcp . 80 : goto svc/shop/web/tcp/http }"
        )
    );
    let flush = text.find("flush table inet wasmplane-s0\n").unwrap();
    assert!(text.find("add map inet wasmplane-s0 service-ips ").unwrap() < flush, "maps exist before they are flushed");
    assert!(text.find("flush map inet wasmplane-s0 service-ips\n").unwrap() > flush);
}

#[test]
fn ipv6_keys_go_to_the_v6_map() {
    let out = ruleset(
        vec![dnat_chain("svc/shop/web/tcp/http", "fd00::11")],
        vec![element("service-ips", "fd00:96::20", Verdict::Goto("svc/shop/web/tcp/http".into()))],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    assert!(rules.elements.contains_key(&("service-ips6".into(), "fd00:96::20 . tcp . 80".into())));
    assert_eq!(rules.chains["svc/shop/web/tcp/http"][0], "meta l4proto tcp dnat ip6 to [fd00::11]:8080");
}

#[test]
fn rejects_what_is_not_its_own_or_not_well_formed() {
    let cases = vec![
        (ruleset(vec![dnat_chain("svc/shop/other/x", "10.244.0.1")], vec![]), "outside"),
        (ruleset(vec![dnat_chain("evil", "10.244.0.1")], vec![]), "outside"),
        (ruleset(vec![dnat_chain("svc/shop/web/x; flush ruleset", "10.244.0.1")], vec![]), "not a valid identifier"),
        (ruleset(vec![dnat_chain("svc/shop/web/x", "10.244.0.1 ; drop")], vec![]), "not an IP address"),
        (
            ruleset(vec![], vec![element("service-ips", "10.96.0.20", Verdict::Goto("svc/shop/web/missing".into()))]),
            "does not declare",
        ),
        (ruleset(vec![], vec![element("filter-input", "10.96.0.20", Verdict::Drop)]), "unknown map"),
        (ruleset(vec![], vec![element("service-ips", "10.96.0.20", Verdict::Accept)]), "cannot hold"),
        (ruleset(vec![], vec![element("no-endpoint-services", "10.96.0.0/24", Verdict::Reject)]), "not an IP address"),
    ];
    for (out, expected) in cases {
        let err = validate_service_output(&key(), &out).unwrap_err();
        assert!(err.reason.contains(expected), "{expected:?} not in {:?}", err.reason);
    }
}

#[test]
fn delta_touches_only_what_changed_in_a_valid_order() {
    let chain = "svc/shop/web/tcp/http";
    let old = validate_service_output(
        &key(),
        &ruleset(
            vec![dnat_chain(chain, "10.244.0.11"), dnat_chain("svc/shop/web/gone", "10.244.0.12")],
            vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into()))],
        ),
    )
    .unwrap();
    let new = validate_service_output(
        &key(),
        &ruleset(
            vec![dnat_chain(chain, "10.244.0.13")],
            vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into()))],
        ),
    )
    .unwrap();
    let mut out = String::new();
    object_delta(&old, &new, &mut out, Layout::default());
    let lines: Vec<&str> = out.lines().collect();
    // The unchanged element is left alone; the changed chain is flushed and refilled; the
    // removed chain is flushed before it is deleted.
    assert!(!out.contains("element"), "{out}");
    let pos = |needle: &str| {
        lines.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("{needle} missing in {out}"))
    };
    assert!(
        pos("flush chain inet wasmplane-s0 svc/shop/web/gone")
            < pos("delete chain inet wasmplane-s0 svc/shop/web/gone")
    );
    assert!(pos(&format!("flush chain inet wasmplane-s0 {chain}")) < pos("dnat ip to 10.244.0.13:8080"));
    let mut nothing = String::new();
    object_delta(&new, &new, &mut nothing, Layout::default());
    assert!(nothing.is_empty());
}

#[test]
fn skeleton_serves_node_ports_on_both_families_and_rejects_unknown_cluster_ip_ports() {
    let mut text = String::new();
    skeleton(&mut text, true, Layout::default(), &NodeNetworks::default());
    for family_rule in [
        "add rule inet wasmplane-s0 services meta l4proto . th dport @service-nodeports jump node-ports",
        "add rule inet wasmplane-s0 node-ports ip daddr != 127.0.0.0/8 fib daddr type local meta l4proto . th dport vmap @service-nodeports",
        "add rule inet wasmplane-s0 node-ports ip6 daddr != ::1 fib daddr type local meta l4proto . th dport vmap @service-nodeports",
        "add rule inet wasmplane endpoints-check meta l4proto . th dport @no-endpoint-nodeports jump no-endpoint-node-ports",
        "add rule inet wasmplane no-endpoint-node-ports ip daddr != 127.0.0.0/8 fib daddr type local meta l4proto . th dport vmap @no-endpoint-nodeports",
        "add rule inet wasmplane no-endpoint-node-ports ip6 daddr != ::1 fib daddr type local meta l4proto . th dport vmap @no-endpoint-nodeports",
        "add set inet wasmplane cluster-ips { type ipv4_addr; }",
        "add set inet wasmplane cluster-ips6 { type ipv6_addr; }",
        "flush set inet wasmplane cluster-ips\n",
        "add rule inet wasmplane cluster-ips-check ip daddr @cluster-ips reject",
        "add rule inet wasmplane cluster-ips-check ip6 daddr @cluster-ips6 reject",
        // After DNAT: forwarded packets were translated at prerouting, local ones at output -100.
        "add chain inet wasmplane filter-output-post-dnat { type filter hook output priority -90; policy accept; }",
        "add rule inet wasmplane filter-output-post-dnat ct state new jump cluster-ips-check",
        "add rule inet wasmplane filter-forward ct state new jump cluster-ips-check",
    ] {
        assert!(text.lines().any(|l| l == family_rule.trim_end()), "missing {family_rule:?} in\n{text}");
    }
    // The check comes after the no-endpoint check (which rejects or drops on its own terms).
    let pos = |needle: &str| text.find(needle).unwrap();
    assert!(
        pos("filter-forward ct state new jump endpoints-check")
            < pos("filter-forward ct state new jump cluster-ips-check")
    );
    assert!(!text.contains("filter-input ct state new jump cluster-ips-check"), "input is not routed on");
}

#[test]
fn node_ports_are_served_on_the_addresses_chosen() {
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let node_ips = [ip("203.0.113.10"), ip("192.168.56.10"), ip("fd00::10"), ip("192.168.56.11")];
    let local = [ip("127.0.0.1"), ip("192.168.56.10"), ip("10.0.0.5"), ip("::1"), ip("fd00::10"), ip("fd00:1::5")];
    assert_eq!(NodePortAddresses::All.select(&node_ips, &local), None);
    assert_eq!(
        NodePortAddresses::Primary.select(&node_ips, &local),
        Some(vec![ip("203.0.113.10"), ip("fd00::10")]),
        "the first of each family"
    );
    let networks: NodePortAddresses = "192.168.0.0/16, fd00::/64,127.0.0.0/8".parse().unwrap();
    assert_eq!(
        networks.select(&node_ips, &local),
        Some(vec![ip("192.168.56.10"), ip("fd00::10")]),
        "local addresses inside, never loopback"
    );
    assert_eq!("primary".parse(), Ok(NodePortAddresses::Primary));
    assert_eq!("10.0.0.1/8".parse(), Ok(NodePortAddresses::Networks(vec!["10.0.0.0/8".parse().unwrap()])));
    assert!("10.0.0.0/8,lan".parse::<NodePortAddresses>().unwrap_err().contains("\"lan\" is not a CIDR"));
    assert_eq!(NodePortAddresses::Primary.select(&[], &local), Some(vec![]), "no node address known: no node port");

    // Chosen addresses: every table looks them up in its own set, no route lookup.
    let networks =
        NodeNetworks { node_port_ips: Some(vec![ip("192.168.56.10"), ip("fd00::10")]), ..Default::default() };
    let mut text = String::new();
    skeleton(&mut text, true, Layout { shards: 2 }, &networks);
    for line in [
        "add rule inet wasmplane-s1 node-ports ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
        "add rule inet wasmplane-s1 node-ports ip6 daddr @nodeport-ips6 meta l4proto . th dport vmap @service-nodeports",
        "add element inet wasmplane-s1 nodeport-ips { 192.168.56.10 }",
        "add element inet wasmplane-s0 nodeport-ips6 { fd00::10 }",
        "add rule inet wasmplane no-endpoint-node-ports ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
        "add element inet wasmplane nodeport-ips { 192.168.56.10 }",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    // (Host ports are served on every local address whatever node ports do, as portmap's.)
    assert!(!text.lines().any(|l| l.contains("node-ports") && l.contains("fib daddr type local")), "{text}");
    let pos = |needle: &str| text.find(needle).unwrap();
    assert!(
        pos("flush set inet wasmplane-s1 nodeport-ips\n") < pos("add element inet wasmplane-s1 nodeport-ips {"),
        "emptied before refilled"
    );
}

fn cluster_ip(ip: &str) -> MapElement {
    MapElement { map_name: "cluster-ips".into(), key: vec![KeyPart::Address(ip.into())], verdict: Verdict::None }
}

#[test]
fn cluster_ips_go_to_the_host_set_only_for_addresses_the_object_serves() {
    let chain = "svc/shop/web/tcp/http";
    let out = ruleset(
        vec![dnat_chain(chain, "10.244.0.11")],
        vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into())), cluster_ip("10.96.0.20")],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    assert_eq!(rules.elements[&("cluster-ips".into(), "10.96.0.20".into())], "");
    let text = full_transaction([&rules].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    assert!(text.contains("add element inet wasmplane cluster-ips { 10.96.0.20 }\n"), "{text}");
    let mut delta = String::new();
    object_delta(&rules, &ObjectRules::default(), &mut delta, Layout::default());
    assert!(delta.contains("delete element inet wasmplane cluster-ips { 10.96.0.20 }\n"), "{delta}");

    // A service without endpoints still owns its address; IPv6 goes to the v6 set.
    let out = ruleset(
        vec![],
        vec![element("no-endpoint-services", "fd00:96::20", Verdict::Reject), cluster_ip("fd00:96::20")],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    assert!(rules.elements.contains_key(&("cluster-ips6".into(), "fd00:96::20".into())));

    // Claiming an address it does not serve (the node's), or with a verdict, is refused.
    for (bad, expected) in [
        (
            vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into())), cluster_ip("192.168.0.1")],
            "not the address of any",
        ),
        (
            vec![
                element("service-ips", "10.96.0.20", Verdict::Goto(chain.into())),
                MapElement {
                    map_name: "cluster-ips".into(),
                    key: vec![KeyPart::Address("10.96.0.20".into())],
                    verdict: Verdict::Drop,
                },
            ],
            "cannot hold",
        ),
        (vec![element("cluster-ips", "10.96.0.20", Verdict::None)], "wrong shape"),
    ] {
        let err = validate_service_output(&key(), &ruleset(vec![dnat_chain(chain, "10.244.0.11")], bad)).unwrap_err();
        assert!(err.reason.contains(expected), "{expected:?} not in {:?}", err.reason);
    }
}

fn with_set(elements: &[&str], timeout: Option<u32>) -> ObjectRules {
    let chain = Chain {
        name: "svc/shop/web/from-peers".into(),
        rules: vec![Rule {
            matches: vec![RuleMatch::SourceInSet("svc/shop/web/peers".into())],
            statements: vec![],
            verdict: Verdict::Accept,
            comment: None,
        }],
    };
    let set = SetDeclaration {
        name: "svc/shop/web/peers".into(),
        family: AddressFamily::Ipv4,
        timeout_seconds: timeout,
        elements: elements.iter().map(|e| e.to_string()).collect(),
    };
    validate_service_output(
        &key(),
        &Ruleset { chains: vec![chain], sets: vec![set], map_elements: vec![], warnings: vec![] },
    )
    .unwrap()
}

#[test]
fn set_elements_change_as_element_deltas() {
    let old = with_set(&["10.244.0.1", "10.244.0.2"], None);
    let new = with_set(&["10.244.0.2", "10.244.0.3"], None);
    let mut out = String::new();
    object_delta(&old, &new, &mut out, Layout::default());
    assert_eq!(
        out,
        "delete element inet wasmplane-s0 svc/shop/web/peers { 10.244.0.1 }\n\
         add element inet wasmplane-s0 svc/shop/web/peers { 10.244.0.3 }\n",
        "only the difference, the set and the chains using it stay"
    );
    // Elements of a set whose elements can expire: re-added before the delete, so a delete
    // of one that timed out cannot fail the transaction.
    let (old, new) = (with_set(&["10.244.0.1", "10.244.0.2"], Some(60)), with_set(&["10.244.0.2"], Some(60)));
    let mut out = String::new();
    object_delta(&old, &new, &mut out, Layout::default());
    assert_eq!(
        out,
        "add element inet wasmplane-s0 svc/shop/web/peers { 10.244.0.1 }\n\
         delete element inet wasmplane-s0 svc/shop/web/peers { 10.244.0.1 }\n"
    );
    // A changed declaration replaces the set: chains flushed first, the set declared anew
    // with its elements, the chains refilled.
    let old = with_set(&["10.244.0.1"], None);
    let new = with_set(&["10.244.0.1"], Some(30));
    let mut out = String::new();
    object_delta(&old, &new, &mut out, Layout::default());
    let lines: Vec<&str> = out.lines().collect();
    let pos = |needle: &str| {
        lines.iter().position(|l| l.starts_with(needle)).unwrap_or_else(|| panic!("{needle} missing in {out}"))
    };
    assert!(
        pos("flush chain inet wasmplane-s0 svc/shop/web/from-peers")
            < pos("delete set inet wasmplane-s0 svc/shop/web/peers")
    );
    assert!(
        pos("delete set")
            < pos(
                "add set inet wasmplane-s0 svc/shop/web/peers { type ipv4_addr; flags dynamic,timeout; timeout 30s; elements = { 10.244.0.1 }; }"
            )
    );
    assert!(
        pos("add set") < pos("add rule inet wasmplane-s0 svc/shop/web/from-peers ip saddr @svc/shop/web/peers accept")
    );
    // The full document declares the set with its elements in one statement.
    let text = full_transaction([&new].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    assert!(text.contains("add set inet wasmplane-s0 svc/shop/web/peers { type ipv4_addr; flags dynamic,timeout; timeout 30s; elements = { 10.244.0.1 }; }"), "{text}");
}

/// A UDP service in kube-proxy's shape (the default translator's with session affinity, or
/// an uploaded one): cluster IP and node port, one chain per endpoint, the pick cascade in
/// the service chain, the external chain going to it. Without endpoint chains (the default
/// translator's DNAT in the service chain): the test after this one.
fn udp_service(protocol: Protocol, endpoints: &[&str]) -> ObjectRules {
    let p = match protocol {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    };
    let svc = format!("svc/shop/web/{p}/dns");
    let mut chains = Vec::new();
    let mut pick = Vec::new();
    for ep in endpoints {
        let name = format!("{svc}/ep/{ep}/8053");
        chains.push(Chain {
            name: name.clone(),
            rules: vec![Rule {
                matches: vec![RuleMatch::Protocol(protocol)],
                statements: vec![RuleStatement::Dnat(DnatTarget { address: ep.to_string(), port: 8053 })],
                verdict: Verdict::None,
                comment: Some("dnat to an endpoint: goto nowhere".into()),
            }],
        });
        pick.push(Rule { matches: vec![], statements: vec![], verdict: Verdict::Goto(name), comment: None });
    }
    let mut elements = Vec::new();
    let service_key = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(protocol), KeyPart::Port(53)];
    let node_port = vec![KeyPart::Protocol(protocol), KeyPart::Port(30053)];
    if endpoints.is_empty() {
        elements.push(MapElement {
            map_name: "no-endpoint-services".into(),
            key: service_key("10.96.0.53"),
            verdict: Verdict::Reject,
        });
        elements.push(MapElement {
            map_name: "no-endpoint-nodeports".into(),
            key: node_port,
            verdict: Verdict::Reject,
        });
    } else {
        chains.push(Chain {
            name: format!("{svc}/external"),
            rules: vec![Rule {
                matches: vec![],
                statements: vec![],
                verdict: Verdict::Goto(svc.clone()),
                comment: None,
            }],
        });
        chains.push(Chain { name: svc.clone(), rules: pick });
        elements.push(MapElement {
            map_name: "service-ips".into(),
            key: service_key("10.96.0.53"),
            verdict: Verdict::Goto(svc.clone()),
        });
        elements.push(MapElement {
            map_name: "service-nodeports".into(),
            key: node_port,
            verdict: Verdict::Goto(format!("{svc}/external")),
        });
    }
    validate_service_output(&key(), &Ruleset { chains, sets: vec![], map_elements: elements, warnings: vec![] })
        .unwrap()
}

#[test]
fn conntrack_cleanup_follows_the_dnat_targets_a_service_lost() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let lost = |ep: &str, destination: Option<&str>, port: u16| ConntrackFilter {
        protocol: "udp",
        ipv6: false,
        destination: destination.map(ip),
        port,
        endpoint: Some((ip(ep), 8053)),
    };
    // Order is not part of the contract.
    let sorted = |mut filters: Vec<ConntrackFilter>| {
        filters.sort_by_key(|f| f.args());
        filters
    };
    let two = udp_service(Protocol::Udp, &["10.244.0.11", "10.244.0.12"]);
    let one = udp_service(Protocol::Udp, &["10.244.0.11"]);
    // An endpoint goes: its flows through the cluster IP and through the node port.
    assert_eq!(
        sorted(conntrack_cleanup(&two, &one)),
        sorted(vec![lost("10.244.0.12", Some("10.96.0.53"), 53), lost("10.244.0.12", None, 30053)])
    );
    assert_eq!(
        lost("10.244.0.12", Some("10.96.0.53"), 53).args().join(" "),
        "-D -f ipv4 -p udp --orig-dst 10.96.0.53 --orig-port-dst 53 --reply-src 10.244.0.12 --reply-port-src 8053"
    );
    // Nothing lost, nothing cleaned: scale-up, an unchanged service.
    assert!(conntrack_cleanup(&one, &two).is_empty());
    assert!(conntrack_cleanup(&two, &two).is_empty());
    // The service goes: every flow of it.
    assert_eq!(
        sorted(conntrack_cleanup(&one, &ObjectRules::default())),
        sorted(vec![lost("10.244.0.11", Some("10.96.0.53"), 53), lost("10.244.0.11", None, 30053)])
    );
    // From no endpoints to some: every flow of its addresses (made while it rejected).
    let none = udp_service(Protocol::Udp, &[]);
    let all = |destination: Option<&str>, port| ConntrackFilter {
        protocol: "udp",
        ipv6: false,
        destination: destination.map(ip),
        port,
        endpoint: None,
    };
    assert_eq!(sorted(conntrack_cleanup(&none, &one)), sorted(vec![all(Some("10.96.0.53"), 53), all(None, 30053)]));
    assert_eq!(all(None, 30053).args().join(" "), "-D -f ipv4 -p udp --orig-port-dst 30053");
    // ... and when they go to none, the lost endpoint's flows.
    assert_eq!(
        sorted(conntrack_cleanup(&one, &none)),
        sorted(vec![lost("10.244.0.11", Some("10.96.0.53"), 53), lost("10.244.0.11", None, 30053)])
    );
    // SCTP like UDP; TCP is left alone (like kube-proxy).
    let sctp = conntrack_cleanup(
        &udp_service(Protocol::Sctp, &["10.244.0.11", "10.244.0.12"]),
        &udp_service(Protocol::Sctp, &["10.244.0.11"]),
    );
    assert_eq!(sctp.len(), 2);
    assert!(sctp.iter().all(|f| f.protocol == "sctp"));
    assert!(
        conntrack_cleanup(
            &udp_service(Protocol::Tcp, &["10.244.0.11", "10.244.0.12"]),
            &udp_service(Protocol::Tcp, &["10.244.0.11"])
        )
        .is_empty()
    );
}

#[test]
fn a_full_transaction_declares_every_chain_before_any_rule_jumps() {
    // Object "a" sorts first and jumps to a chain of object "b" (as a pod's dispatch chain
    // jumps to each policy's chain): "b"'s chain must exist before "a"'s rule.
    let mut a = ObjectRules::default();
    a.chains.insert("polpod/10.244.0.1/ingress".into(), vec!["jump pol/ns/p/ingress".into()]);
    let mut b = ObjectRules::default();
    b.chains.insert("pol/ns/p/ingress".into(), vec!["ip saddr 10.244.0.2 accept".into()]);
    let text = full_transaction([&a, &b].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    let declared = text.find("add chain inet wasmplane pol/ns/p/ingress").expect("declared");
    let jumped = text.find("jump pol/ns/p/ingress").expect("the jump");
    assert!(declared < jumped, "{text}");
}

#[test]
fn layouts_grow_by_powers_of_two_up_to_a_cap() {
    assert_eq!(Layout::for_services(0, 1024).shards, 1);
    assert_eq!(Layout::for_services(1024, 1024).shards, 1);
    assert_eq!(Layout::for_services(1025, 1024).shards, 2);
    assert_eq!(Layout::for_services(3000, 1024).shards, 4);
    assert_eq!(Layout::for_services(50_000, 1024).shards, 64);
    assert_eq!(Layout::for_services(1_000_000, 1024).shards, Layout::MAX_SHARDS);
    assert_eq!(Layout::for_services(5, 0).shards, 8, "a per-shard count of 0 means 1");
}

#[test]
fn a_service_keeps_all_its_names_in_one_shard_and_everything_else_in_the_main_table() {
    let layout = Layout { shards: 16 };
    for i in 0..50 {
        let service = format!("svc/ns{i}/web");
        let t = layout.table_of(&service);
        assert_ne!(t, Table::MAIN);
        for name in [format!("{service}/tcp/http"), format!("{service}/ep/10.244.0.1/affinity")] {
            assert_eq!(layout.table_of(&name), t, "{name}");
        }
        assert_eq!(layout.element_table("service-ips", &format!("goto {service}/tcp/http"), None), t);
        assert_eq!(layout.element_table("service-nodeports", &format!("goto {service}"), None), t);
        // The shared checks stay in the main table.
        assert_eq!(layout.element_table("no-endpoint-services", "goto reject-chain", None), Table::MAIN);
        assert_eq!(layout.element_table("cluster-ips", "", None), Table::MAIN);
        // Data elements, count sets and gotos to a shard's by-count chains follow the
        // object's name.
        assert_eq!(layout.element_table("service-endpoints", "10.244.0.1 . 80", Some(&service)), t);
        assert_eq!(layout.element_table("service-ips", "goto pick-by-count", Some(&service)), t);
        assert_eq!(layout.element_table("frontends-3", "", Some(&service)), t);
        assert_eq!(layout.element_table("nodeports6-32", "", Some(&service)), t);
        assert_eq!(layout.element_table("hairpin", "", Some(&service)), Table::MAIN);
        // Only the names `CountedKeys::set` spells are count sets.
        for name in [
            "frontends-01".to_string(),
            "frontends-+3".into(),
            "frontends-0".into(),
            "frontends-".into(),
            "backends-3".into(),
            format!("frontends-{}", MAX_PICK + 1),
        ] {
            assert_eq!(layout.element_table(&name, "", Some(&service)), Table::MAIN, "{name}");
        }
    }
    let used: BTreeSet<Table> = (0..200).map(|i| layout.table_of(&format!("svc/ns/s{i}"))).collect();
    assert_eq!(used.len(), 16, "200 services cover every one of 16 shards");
    for name in ["pol/a/p/ingress", "polpod/10.244.1.10/ingress", "services"] {
        assert_eq!(layout.table_of(name), Table::MAIN);
    }
    // The same name, the same shard: the hash does not depend on the process.
    assert_eq!(
        Layout { shards: 1 << 20 }.table_of("svc/default/kubernetes"),
        Table::shard(0x13797),
        "FNV-1a 64 of \"default/kubernetes\" mod 2^20"
    );
}

#[test]
fn table_names_parse_back_and_nothing_else_is_ours() {
    for t in [Table::MAIN, Table::shard(0), Table::shard(63)] {
        assert_eq!(Table::parse(&t.name()), Some(t));
        assert_eq!(t.to_string(), format!("inet {}", t.name()));
    }
    for other in
        ["wasmplane-s", "wasmplane-x1", "wasmplane-s1a", "kube-proxy", "wasmplane2", "wasmplane-s007", "wasmplane-s+7"]
    {
        assert_eq!(Table::parse(other), None, "{other}");
        assert!(!is_our_table(other));
    }
}

#[test]
fn a_full_transaction_declares_every_shard_and_deletes_stale_tables_last() {
    let layout = Layout { shards: 2 };
    let stale = Stale {
        tables: vec![Table::shard(5)],
        chains: vec![(Table::shard(1), "svc/a/b".into())],
        sets: vec![],
        unsharded_main: false,
    };
    let text = full_transaction(std::iter::empty(), &stale, layout, &NodeNetworks::default());
    for t in ["inet wasmplane", "inet wasmplane-s0", "inet wasmplane-s1"] {
        assert!(text.contains(&format!("add table {t}\n")) && text.contains(&format!("flush table {t}\n")), "{t}");
    }
    assert!(
        text.contains("add chain inet wasmplane-s1 nat-output { type nat hook output priority -100; policy accept; }")
    );
    assert!(!text.contains("add chain inet wasmplane nat-prerouting"), "the main table has no service NAT chains");
    assert!(text.ends_with("delete chain inet wasmplane-s1 svc/a/b\ndelete table inet wasmplane-s5\n"), "{text}");
}

fn hairpin(ip: &str) -> MapElement {
    MapElement { map_name: "hairpin".into(), key: vec![KeyPart::Address(ip.into())], verdict: Verdict::None }
}

#[test]
fn hairpin_endpoints_are_address_pairs_of_their_family_written_once_however_many_services_name_them() {
    let web =
        validate_service_output(&key(), &ruleset(vec![], vec![hairpin("10.244.0.11"), hairpin("fd00::11")])).unwrap();
    let both = |ip: &str| format_compact!("{ip} . {ip}");
    assert_eq!(web.elements.get(&("hairpin".into(), both("10.244.0.11"))).map(CompactString::as_str), Some(""));
    assert_eq!(web.elements.get(&("hairpin6".into(), both("fd00::11"))).map(CompactString::as_str), Some(""));
    for (bad, why) in [
        (MapElement { verdict: Verdict::Accept, ..hairpin("10.244.0.11") }, "cannot hold verdict"),
        (MapElement { key: vec![KeyPart::Address("10.244.0.0/24".into())], ..hairpin("") }, "not an IP address"),
        (element("hairpin", "10.244.0.11", Verdict::None), "wrong shape"),
    ] {
        let err = validate_service_output(&key(), &ruleset(vec![], vec![bad])).unwrap_err();
        assert!(err.reason.contains(why), "{err}");
    }
    assert!(
        is_shared_set("hairpin")
            && is_shared_set("hairpin6")
            && !is_shared_set("cluster-ips")
            && !is_shared_set("service-ips")
    );

    // Another service with the same pod behind it: the full transaction adds the pair once.
    let api = validate_service_output(
        &ObjectKey::new("shop", "api"),
        &ruleset(vec![], vec![hairpin("10.244.0.11"), hairpin("10.244.0.12")]),
    )
    .unwrap();
    let text =
        full_transaction([&web, &api].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    assert!(
        text.contains("add element inet wasmplane hairpin { 10.244.0.11 . 10.244.0.11, 10.244.0.12 . 10.244.0.12 }\n"),
        "{text}"
    );
    assert_eq!(text.matches("10.244.0.11 . 10.244.0.11").count(), 1, "{text}");
    // The set is declared, emptied with the table and consulted after DNAT at postrouting.
    for line in [
        "add set inet wasmplane hairpin { type ipv4_addr . ipv4_addr; }",
        "add set inet wasmplane hairpin6 { type ipv6_addr . ipv6_addr; }",
        "flush set inet wasmplane hairpin\n",
        "add rule inet wasmplane nat-postrouting ct status dnat ip saddr . ip daddr @hairpin jump mark-for-masquerade",
    ] {
        assert!(text.contains(line), "{line} missing:\n{text}");
    }
    let pos = |s: &str| text.find(s).unwrap();
    assert!(
        pos("nat-postrouting ct status dnat ip6 saddr") < pos("nat-postrouting jump masquerading"),
        "marked before masquerading"
    );

    // Rendered alone (replay), an object adds and deletes its pairs itself.
    let mut alone = String::new();
    object_delta(&api, &ObjectRules::default(), &mut alone, Layout::default());
    assert!(
        alone.contains(
            "delete element inet wasmplane hairpin { 10.244.0.11 . 10.244.0.11, 10.244.0.12 . 10.244.0.12 }\n"
        ),
        "{alone}"
    );
    // Among other objects, their owners decide (the writer counts them).
    let mut among = String::new();
    objects_delta(&[(&api, &ObjectRules::default())], &mut among, Layout::default());
    assert!(!among.contains("hairpin"), "{among}");
}

#[test]
fn conntrack_cleanup_finds_dnat_targets_in_the_service_chain_itself() {
    // The default translator's shape: the service chain DNATs, no endpoint chains.
    let service = |endpoints: &[&str]| {
        let n = endpoints.len() as u32;
        let rules = endpoints
            .iter()
            .enumerate()
            .map(|(i, ep)| Rule {
                matches: if n - (i as u32) > 1 {
                    vec![RuleMatch::Random((n - i as u32, 0)), RuleMatch::Protocol(Protocol::Udp)]
                } else {
                    vec![RuleMatch::Protocol(Protocol::Udp)]
                },
                statements: vec![RuleStatement::Dnat(DnatTarget { address: ep.to_string(), port: 8053 })],
                verdict: Verdict::None,
                comment: None,
            })
            .collect();
        let svc = "svc/shop/web/udp/dns".to_string();
        let frontend = vec![KeyPart::Address("10.96.0.53".into()), KeyPart::Protocol(Protocol::Udp), KeyPart::Port(53)];
        let out = Ruleset {
            chains: vec![Chain { name: svc.clone(), rules }],
            sets: vec![],
            map_elements: vec![MapElement {
                map_name: "service-ips".into(),
                key: frontend,
                verdict: Verdict::Goto(svc),
            }],
            warnings: vec![],
        };
        validate_service_output(&key(), &out).unwrap()
    };
    let filters = conntrack_cleanup(
        &service(&["10.244.0.11", "10.244.0.12", "10.244.0.13"]),
        &service(&["10.244.0.11", "10.244.0.13"]),
    );
    let lost = ConntrackFilter {
        protocol: "udp",
        ipv6: false,
        destination: Some("10.96.0.53".parse().unwrap()),
        port: 53,
        endpoint: Some(("10.244.0.12".parse().unwrap(), 8053)),
    };
    assert_eq!(filters, vec![lost]);
}

fn backend(frontend: &str, protocol: Protocol, port: u16, address: &str, backend_port: u16) -> MapElement {
    MapElement {
        map_name: "service-backends".into(),
        key: vec![
            KeyPart::Address(frontend.into()),
            KeyPart::Protocol(protocol),
            KeyPart::Port(port),
            KeyPart::Address(address.into()),
            KeyPart::Port(backend_port),
        ],
        verdict: Verdict::None,
    }
}

fn frontend_set(map: &str, ip: &str) -> MapElement {
    MapElement {
        map_name: map.into(),
        key: vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)],
        verdict: Verdict::None,
    }
}

#[test]
fn backends_as_data_are_numbered_in_the_endpoint_maps_and_counted_in_the_count_set_of_their_number() {
    let out = ruleset(
        vec![],
        vec![
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.12", 8080),
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080),
            backend("fd00:96::20", Protocol::Udp, 53, "fd00::11", 5353),
            frontend_set("masquerade-off-cluster", "10.96.0.20"),
            cluster_ip("10.96.0.20"),
        ],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    let get = |map: &str, k: &str| rules.elements.get(&(map.into(), k.into())).map(CompactString::as_str);
    assert_eq!(get("service-endpoints", "10.96.0.20 . tcp . 80 . 0"), Some("10.244.0.11 . 8080"));
    assert_eq!(get("service-endpoints", "10.96.0.20 . tcp . 80 . 1"), Some("10.244.0.12 . 8080"));
    assert_eq!(get("service-ips", "10.96.0.20 . tcp . 80"), Some("goto pick-by-count"));
    assert_eq!(get("frontends-2", "10.96.0.20 . tcp . 80"), Some(""));
    assert_eq!(get("service-endpoints6", "fd00:96::20 . udp . 53 . 0"), Some("fd00::11 . 5353"));
    assert_eq!(get("service-ips6", "fd00:96::20 . udp . 53"), Some("goto pick-by-count6"));
    assert_eq!(get("frontends6-1", "fd00:96::20 . udp . 53"), Some(""));
    assert_eq!(
        rules.elements.keys().filter(|(map, _)| map.starts_with("frontends")).count(),
        2,
        "one count per frontend"
    );
    assert_eq!(get("masquerade-off-cluster", "10.96.0.20 . tcp . 80"), Some(""));
    assert!(rules.is_sharded() && rules.chains.is_empty());

    // All of it in the service's shard; the shard has the pick chains and its cluster CIDRs.
    let layout = Layout { shards: 4 };
    let shard = layout.table_of("svc/shop/web");
    let cidrs: Vec<IpNet> = vec!["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()];
    let service_cidrs: Vec<IpNet> = vec!["10.96.0.0/12".parse().unwrap(), "fd00:96::/108".parse().unwrap()];
    let text = full_transaction(
        [&rules].into_iter(),
        &Stale::default(),
        layout,
        &NodeNetworks { cluster_cidrs: cidrs, service_cidrs, ..Default::default() },
    );
    for line in [
        format!("add set {shard} frontends-{MAX_PICK} {{ type ipv4_addr . inet_proto . inet_service; }}"),
        format!("flush set {shard} frontends6-1"),
        format!("add rule {shard} pick-by-count ip daddr . meta l4proto . th dport @frontends-1 goto pick-1"),
        format!(
            "add rule {shard} pick-by-count6 ip6 daddr . meta l4proto . th dport @frontends6-{MAX_PICK} goto pick-{MAX_PICK}"
        ),
        format!(
            "add rule {shard} pick-2 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 2 map @service-endpoints"
        ),
        format!("add rule {shard} pick-{MAX_PICK} jump masquerade-check"),
        format!("add element {shard} cluster-cidrs {{ 10.244.0.0/16 }}"),
        format!("add element {shard} cluster-cidrs6 {{ fd00:10:244::/56 }}"),
        // The service CIDRs in the main table, where `cluster-ips-check` drops what is no
        // service's.
        format!("add element {} service-cidrs {{ 10.96.0.0/12 }}", Table::MAIN),
        format!("add element {} service-cidrs6 {{ fd00:96::/108 }}", Table::MAIN),
    ] {
        assert!(text.contains(&line), "{line} missing");
    }
    for (set, element) in [
        ("service-endpoints", "10.96.0.20 . tcp . 80 . 1 : 10.244.0.12 . 8080"),
        ("service-ips", "10.96.0.20 . tcp . 80 : goto pick-by-count"),
        ("frontends-2", "10.96.0.20 . tcp . 80"),
        ("masquerade-off-cluster", "10.96.0.20 . tcp . 80"),
    ] {
        assert!(has_element(&text, &shard.to_string(), set, element), "{set}: {element} missing");
    }
    assert!(
        !text.contains(&format!("pick-{} ", MAX_PICK + 1)) && !text.contains(&format!("frontends-{} ", MAX_PICK + 1))
    );
    // The smallest count is tried first: a frontend of N backends costs a new connection N
    // set lookups.
    assert!(text.find("@frontends-1 goto pick-1\n") < text.find("@frontends-2 goto pick-2\n"));
    // An endpoint change is element deltas only: one number's backend, no chain touched.
    let out = ruleset(
        vec![],
        vec![
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080),
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.13", 8080),
        ],
    );
    let next = validate_service_output(&key(), &out).unwrap();
    let mut delta = String::new();
    objects_delta(&[(&rules, &next)], &mut delta, layout);
    assert!(
        delta.contains(&format!("delete element {shard} service-endpoints {{ 10.96.0.20 . tcp . 80 . 1 }}")),
        "{delta}"
    );
    assert!(
        delta.contains(&format!(
            "add element {shard} service-endpoints {{ 10.96.0.20 . tcp . 80 . 1 : 10.244.0.13 . 8080 }}"
        )),
        "{delta}"
    );
    assert!(!delta.contains("chain") && !delta.contains("service-ips {"), "{delta}");

    // Scaling is element deltas of plain sets: the frontend moves from one count set to the
    // next, and no element with a goto is written (it would make the kernel validate the
    // whole table: see `CountedKeys`).
    let out = ruleset(
        vec![],
        ["10.244.0.11", "10.244.0.12", "10.244.0.13"]
            .map(|b| backend("10.96.0.20", Protocol::Tcp, 80, b, 8080))
            .to_vec(),
    );
    let scaled = validate_service_output(&key(), &out).unwrap();
    let mut delta = String::new();
    objects_delta(&[(&next, &scaled)], &mut delta, layout);
    assert!(delta.contains(&format!("delete element {shard} frontends-2 {{ 10.96.0.20 . tcp . 80 }}")), "{delta}");
    assert!(delta.contains(&format!("add element {shard} frontends-3 {{ 10.96.0.20 . tcp . 80 }}")), "{delta}");
    assert!(
        delta.contains(&format!(
            "add element {shard} service-endpoints {{ 10.96.0.20 . tcp . 80 . 2 : 10.244.0.13 . 8080 }}"
        )),
        "{delta}"
    );
    assert!(!delta.contains("goto") && !delta.contains("jump") && !delta.contains("chain"), "{delta}");
}

#[test]
fn a_full_transaction_writes_each_set_and_map_in_one_statement() {
    let service = |name: &str, ip: &str| {
        let out =
            ruleset(vec![], ["10.244.0.11", "10.244.0.12"].map(|b| backend(ip, Protocol::Tcp, 80, b, 8080)).to_vec());
        validate_service_output(&ObjectKey::new("shop", name), &out).unwrap()
    };
    let (web, api) = (service("web", "10.96.0.20"), service("api", "10.96.0.21"));
    let text =
        full_transaction([&web, &api].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    let statements = |set: &str| -> Vec<&str> {
        text.lines().filter(|l| l.starts_with(&format!("add element inet wasmplane-s0 {set} "))).collect()
    };
    assert_eq!(
        statements("frontends-2"),
        ["add element inet wasmplane-s0 frontends-2 { 10.96.0.20 . tcp . 80, 10.96.0.21 . tcp . 80 }"]
    );
    assert_eq!(
        statements("service-ips"),
        [
            "add element inet wasmplane-s0 service-ips { 10.96.0.20 . tcp . 80 : goto pick-by-count, 10.96.0.21 . tcp . 80 : goto pick-by-count }"
        ]
    );
    let endpoints = statements("service-endpoints");
    assert_eq!(endpoints.len(), 1, "{endpoints:?}");
    for ip in ["10.96.0.20", "10.96.0.21"] {
        for (n, backend) in [(0, "10.244.0.11"), (1, "10.244.0.12")] {
            assert!(
                has_element(
                    &text,
                    "inet wasmplane-s0",
                    "service-endpoints",
                    &format!("{ip} . tcp . 80 . {n} : {backend} . 8080")
                ),
                "{ip} #{n}: {endpoints:?}"
            );
        }
    }
}

/// Whether a statement `add element {table} {set} { … }` of `text` holds `element`.
pub(crate) fn has_element(text: &str, table: &str, set: &str, element: &str) -> bool {
    let opening = format!("add element {table} {set} {{ ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&opening)?.strip_suffix(" }"))
        .any(|body| body.split(", ").any(|e| e == element))
}

#[test]
fn backends_as_data_are_refused_when_they_do_not_add_up() {
    let too_many: Vec<MapElement> =
        (0..=MAX_PICK).map(|i| backend("10.96.0.20", Protocol::Tcp, 80, &format!("10.244.1.{i}"), 8080)).collect();
    for (elements, why) in [
        (too_many, "limit"),
        (vec![backend("10.96.0.20", Protocol::Tcp, 80, "fd00::11", 8080)], "another address family"),
        (
            vec![
                backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080),
                element("service-ips", "10.96.0.20", Verdict::Reject),
            ],
            "cannot hold verdict",
        ),
        (vec![frontend_set("masquerade-always", "10.96.0.99")], "not a frontend of this object"),
        (
            vec![MapElement {
                verdict: Verdict::Accept,
                ..backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080)
            }],
            "wrong shape",
        ),
    ] {
        let err = validate_service_output(&key(), &ruleset(vec![], elements)).unwrap_err();
        assert!(err.reason.contains(why), "{why}: {err}");
    }
    // The frontend named both ways.
    let both = ruleset(
        vec![dnat_chain("svc/shop/web/tcp/http", "10.244.0.11")],
        vec![
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080),
            element("service-ips", "10.96.0.20", Verdict::Goto("svc/shop/web/tcp/http".into())),
        ],
    );
    assert!(validate_service_output(&key(), &both).unwrap_err().reason.contains("given twice"));
}

fn node_port_backend(port: u16, address: &str, backend_port: u16) -> MapElement {
    MapElement {
        map_name: "nodeport-backends".into(),
        key: vec![
            KeyPart::Protocol(Protocol::Tcp),
            KeyPart::Port(port),
            KeyPart::Address(address.into()),
            KeyPart::Port(backend_port),
        ],
        verdict: Verdict::None,
    }
}

#[test]
fn node_port_backends_are_numbered_per_family_and_dispatched_by_the_host() {
    let out = ruleset(
        vec![],
        vec![
            node_port_backend(30080, "10.244.0.12", 8080),
            node_port_backend(30080, "10.244.0.11", 8080),
            node_port_backend(30080, "fd00::11", 8080),
            node_port_backend(30081, "10.244.0.11", 9090),
        ],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    let get = |map: &str, k: &str| rules.elements.get(&(map.into(), k.into())).map(CompactString::as_str);
    assert_eq!(get("nodeport-endpoints", "tcp . 30080 . 0"), Some("10.244.0.11 . 8080"));
    assert_eq!(get("nodeport-endpoints", "tcp . 30080 . 1"), Some("10.244.0.12 . 8080"));
    assert_eq!(get("nodeport-endpoints6", "tcp . 30080 . 0"), Some("fd00::11 . 8080"));
    assert_eq!(get("nodeport-picks", "tcp . 30080"), Some("goto nodeport-pick-by-count"));
    assert_eq!(get("nodeports-2", "tcp . 30080"), Some(""));
    assert_eq!(get("nodeport-picks6", "tcp . 30080"), Some("goto nodeport-pick-by-count6"));
    assert_eq!(get("nodeports6-1", "tcp . 30080"), Some(""));
    assert_eq!(get("service-nodeports", "tcp . 30080"), Some("goto nodeport-dispatch"));
    // An IPv4-only node port: nothing for IPv6 packets to draw from.
    assert_eq!(get("nodeport-picks", "tcp . 30081"), Some("goto nodeport-pick-by-count"));
    assert_eq!(get("nodeports-1", "tcp . 30081"), Some(""));
    assert_eq!(get("nodeport-picks6", "tcp . 30081"), None);
    assert!(!rules.elements.keys().any(|(map, key)| map.starts_with("nodeports6") && key == "tcp . 30081"));
    assert!(rules.chains.is_empty() && rules.is_sharded());

    // In the service's shard, with the static chains that dispatch and draw.
    let layout = Layout { shards: 4 };
    let shard = layout.table_of("svc/shop/web");
    let text = full_transaction([&rules].into_iter(), &Stale::default(), layout, &NodeNetworks::default());
    for line in [
        format!("add rule {shard} nodeport-dispatch meta nfproto ipv6 meta l4proto . th dport vmap @nodeport-picks6"),
        format!("add rule {shard} nodeport-pick-by-count meta l4proto . th dport @nodeports-2 goto nodeport-pick-2"),
        format!("add rule {shard} nodeport-pick-by-count6 meta l4proto . th dport @nodeports6-1 goto nodeport-pick-1"),
        format!("add rule {shard} nodeport-pick-2 jump mark-for-masquerade"),
        format!(
            "add rule {shard} nodeport-pick-2 meta nfproto ipv4 dnat ip to meta l4proto . th dport . numgen random mod 2 map @nodeport-endpoints"
        ),
    ] {
        assert!(text.contains(&line), "{line} missing");
    }
    assert!(has_element(&text, &shard.to_string(), "nodeport-endpoints", "tcp . 30080 . 1 : 10.244.0.12 . 8080"));
    assert!(has_element(&text, &shard.to_string(), "service-nodeports", "tcp . 30080 : goto nodeport-dispatch"));

    // A backend change is element deltas only.
    let out = ruleset(
        vec![],
        vec![
            node_port_backend(30080, "10.244.0.11", 8080),
            node_port_backend(30080, "10.244.0.13", 8080),
            node_port_backend(30080, "fd00::11", 8080),
            node_port_backend(30081, "10.244.0.11", 9090),
        ],
    );
    let next = validate_service_output(&key(), &out).unwrap();
    let mut delta = String::new();
    objects_delta(&[(&rules, &next)], &mut delta, layout);
    assert!(
        delta.contains(&format!("add element {shard} nodeport-endpoints {{ tcp . 30080 . 1 : 10.244.0.13 . 8080 }}")),
        "{delta}"
    );
    assert!(!delta.contains("chain") && !delta.contains("picks"), "{delta}");

    // Too many of one family, and the port named both ways, are refused.
    let too_many: Vec<MapElement> =
        (0..=MAX_PICK).map(|i| node_port_backend(30080, &format!("10.244.1.{i}"), 8080)).collect();
    assert!(validate_service_output(&key(), &ruleset(vec![], too_many)).unwrap_err().reason.contains("limit"));
    let both = ruleset(
        vec![dnat_chain("svc/shop/web/tcp/http", "10.244.0.11")],
        vec![
            node_port_backend(30080, "10.244.0.11", 8080),
            MapElement {
                map_name: "service-nodeports".into(),
                key: vec![KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(30080)],
                verdict: Verdict::Goto("svc/shop/web/tcp/http".into()),
            },
        ],
    );
    assert!(validate_service_output(&key(), &both).unwrap_err().reason.contains("given twice"));
}

#[test]
fn node_port_udp_backends_gone_clean_up_their_flows() {
    let service = |backends: &[&str]| {
        let elements = backends
            .iter()
            .map(|b| MapElement {
                map_name: "nodeport-backends".into(),
                key: vec![
                    KeyPart::Protocol(Protocol::Udp),
                    KeyPart::Port(30053),
                    KeyPart::Address((*b).into()),
                    KeyPart::Port(53),
                ],
                verdict: Verdict::None,
            })
            .collect();
        validate_service_output(&key(), &ruleset(vec![], elements)).unwrap()
    };
    let filters = conntrack_cleanup(&service(&["10.244.0.11", "10.244.0.12"]), &service(&["10.244.0.11"]));
    assert_eq!(
        filters,
        vec![ConntrackFilter {
            protocol: "udp",
            ipv6: false,
            destination: None,
            port: 30053,
            endpoint: Some(("10.244.0.12".parse().unwrap(), 53))
        }]
    );
}

fn affinity(seconds: u32, ip: &str) -> MapElement {
    MapElement { map_name: format!("session-affinity-{seconds}"), ..frontend_set("", ip) }
}

fn node_port_affinity(seconds: u32, port: u16) -> MapElement {
    MapElement {
        map_name: format!("nodeport-affinity-{seconds}"),
        key: vec![KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(port)],
        verdict: Verdict::None,
    }
}

#[test]
fn session_affinity_as_data_goes_to_the_by_count_chain_of_its_timeout() {
    let out = ruleset(
        vec![],
        vec![
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080),
            backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.12", 8080),
            affinity(10800, "10.96.0.20"),
            node_port_backend(30080, "10.244.0.11", 8080),
            node_port_backend(30080, "fd00::11", 8080),
            node_port_affinity(30, 30080),
        ],
    );
    let rules = validate_service_output(&key(), &out).unwrap();
    let get = |map: &str, k: &str| rules.elements.get(&(map.into(), k.into())).map(CompactString::as_str);
    assert_eq!(get("service-ips", "10.96.0.20 . tcp . 80"), Some("goto affinity-10800-pick-by-count"));
    assert_eq!(get("frontends-2", "10.96.0.20 . tcp . 80"), Some(""));
    assert_eq!(get("nodeport-picks", "tcp . 30080"), Some("goto nodeport-affinity-30-pick-by-count"));
    assert_eq!(get("nodeport-picks6", "tcp . 30080"), Some("goto nodeport-affinity-30-pick-by-count6"));
    assert_eq!((get("nodeports-1", "tcp . 30080"), get("nodeports6-1", "tcp . 30080")), (Some(""), Some("")));
    // The affinity elements themselves are not written anywhere.
    assert!(!rules.elements.keys().any(|(map, _)| map.contains("affinity")), "{:?}", rules.elements);

    let layout = Layout { shards: 4 };
    let shard = layout.table_of("svc/shop/web");
    let classes: BTreeSet<(Table, AffinityClass)> = affinity_classes(&rules, layout).collect();
    assert_eq!(
        classes,
        [
            (shard, AffinityClass { node_port: false, seconds: 10800 }),
            (shard, AffinityClass { node_port: true, seconds: 30 })
        ]
        .into()
    );
    assert_eq!(
        AffinityPick::parse("nodeport-affinity-30-pick-1").map(|p| p.class()),
        Some(AffinityClass { node_port: true, seconds: 30 })
    );
    let text = full_transaction([&rules].into_iter(), &Stale::default(), layout, &NodeNetworks::default());
    let chain = "affinity-10800-pick-2";
    for line in [
        format!("add rule {shard} {chain} jump masquerade-check"),
        // A remembered client back to its backend; else a draw: backend 0 with 1/2, else 1.
        format!("add rule {shard} {chain} jump affinity-10800-lookup"),
        format!("add rule {shard} {chain} numgen random mod 2 == 0 goto affinity-10800-slot-0"),
        format!("add rule {shard} {chain} goto affinity-10800-slot-1"),
        format!(
            "add rule {shard} affinity-10800-lookup meta nfproto ipv4 ip saddr . ip daddr . meta l4proto . th dport @affinity-slot-1 goto affinity-10800-slot-1"
        ),
        format!(
            "add rule {shard} affinity-10800-lookup meta nfproto ipv6 ip6 saddr . ip6 daddr . meta l4proto . th dport @affinity6-slot-31 goto affinity-10800-slot-31"
        ),
        // The slot chain records the client (the timeout restarts) and DNATs.
        format!(
            "add rule {shard} affinity-10800-slot-1 meta nfproto ipv4 update @affinity-slot-1 {{ ip saddr . ip daddr . meta l4proto . th dport timeout 10800s }} dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 offset 1 map @service-endpoints"
        ),
        format!(
            "add rule {shard} affinity-10800-slot-0 meta nfproto ipv6 update @affinity6-slot-0 {{ ip6 saddr . ip6 daddr . meta l4proto . th dport timeout 10800s }} dnat ip6 to ip6 daddr . meta l4proto . th dport . numgen random mod 1 offset 0 map @service-endpoints6"
        ),
        format!("add rule {shard} nodeport-affinity-30-pick-1 jump mark-for-masquerade"),
        format!(
            "add rule {shard} nodeport-affinity-30-slot-0 meta nfproto ipv4 update @affinity-slot-0 {{ ip saddr . ip daddr . meta l4proto . th dport timeout 30s }} dnat ip to meta l4proto . th dport . numgen random mod 1 offset 0 map @nodeport-endpoints"
        ),
        // Every count of a timeout in use, so that a frontend scaling changes its count set.
        format!("add rule {shard} affinity-10800-pick-{MAX_PICK} jump masquerade-check"),
        format!(
            "add rule {shard} affinity-10800-pick-by-count ip daddr . meta l4proto . th dport @frontends-2 goto affinity-10800-pick-2"
        ),
        format!(
            "add rule {shard} affinity-10800-pick-by-count6 ip6 daddr . meta l4proto . th dport @frontends6-1 goto affinity-10800-pick-1"
        ),
        format!(
            "add rule {shard} nodeport-affinity-30-pick-by-count6 meta l4proto . th dport @nodeports6-{MAX_PICK} goto nodeport-affinity-30-pick-{MAX_PICK}"
        ),
        format!(
            "add set {shard} affinity-slot-{} {{ typeof ip saddr . ip daddr . meta l4proto . th dport; size 262144; flags dynamic,timeout; }}",
            MAX_PICK - 1
        ),
    ] {
        assert!(text.contains(&line), "{line} missing");
    }
    // The chains are declared before the element that goes to them.
    assert!(text.find(&format!("add chain {shard} {chain}")) < text.find(&format!("add element {shard} service-ips")));
    assert!(
        text.find(&format!("add chain {shard} affinity-10800-pick-by-count\n"))
            < text.find(&format!("add element {shard} service-ips"))
    );
    // Clients are remembered across full syncs: the slot sets are never flushed.
    assert!(!text.lines().any(|l| l.starts_with("flush set") && l.contains("affinity-slot")));
    // The chains are the host's, named for what they do, and nothing else parses as one.
    assert!(
        !is_static_chain(chain)
            && !is_static_chain("nodeport-affinity-30-lookup")
            && !is_static_chain("affinity-30-slot-31")
            && is_static_chain("pick-2")
    );
    assert_eq!(AffinityClass::of_chain("affinity-30-slot-31"), Some(AffinityClass { node_port: false, seconds: 30 }));
    assert_eq!(AffinityClass::of_chain("affinity-30-slot-32"), None);
    assert_eq!(
        AffinityClass::of_chain("nodeport-affinity-30-lookup"),
        Some(AffinityClass { node_port: true, seconds: 30 })
    );
    assert_eq!(AffinityClass::of_chain("affinity-30-lookups"), None);
    assert_eq!(
        AffinityClass::of_chain("nodeport-affinity-30-pick-by-count6"),
        Some(AffinityClass { node_port: true, seconds: 30 })
    );
    assert_eq!(AffinityClass::of_chain("affinity-30-pick-by-count7"), None);
    assert!(is_static_chain("pick-by-count6") && !is_static_chain("affinity-30-pick-by-count"));
    for name in
        ["affinity-0-pick-2", "affinity-10800-pick-33", "affinity-10800-pick-02", "affinity-x-pick-2", "svc/shop/web"]
    {
        assert_eq!(AffinityPick::parse(name), None, "{name}");
    }
}

#[test]
fn session_affinity_is_refused_when_it_does_not_add_up() {
    let two = || vec![backend("10.96.0.20", Protocol::Tcp, 80, "10.244.0.11", 8080)];
    for (extra, why) in [
        (vec![affinity(0, "10.96.0.20")], "1 to 86400"),
        (vec![affinity(86_401, "10.96.0.20")], "1 to 86400"),
        (vec![MapElement { map_name: "session-affinity-x".into(), ..affinity(1, "10.96.0.20") }], "1 to 86400"),
        (vec![affinity(60, "10.96.0.21")], "has no service-backends"),
        (vec![node_port_affinity(60, 30080)], "has no nodeport-backends"),
        (vec![affinity(60, "10.96.0.20"), affinity(70, "10.96.0.20")], "given twice"),
        (vec![MapElement { verdict: Verdict::Accept, ..affinity(60, "10.96.0.20") }], "wrong shape"),
    ] {
        let mut elements = two();
        elements.extend(extra);
        let err = validate_service_output(&key(), &ruleset(vec![], elements)).unwrap_err();
        assert!(err.reason.contains(why), "{why}: {err}");
    }
}

#[test]
fn backends_with_affinity_keep_their_numbers_across_changes() {
    let service = |backends: &[&str]| {
        let mut elements: Vec<MapElement> =
            backends.iter().map(|b| backend("10.96.0.20", Protocol::Tcp, 80, b, 8080)).collect();
        elements.push(affinity(10800, "10.96.0.20"));
        validate_service_output(&key(), &ruleset(vec![], elements)).unwrap()
    };
    let numbered = |rules: &ObjectRules| -> Vec<String> {
        (0..)
            .map_while(|i| {
                rules.elements.get(&("service-endpoints".into(), format_compact!("10.96.0.20 . tcp . 80 . {i}")))
            })
            .map(|b| b[..11].to_string())
            .collect()
    };
    let old = service(&["10.244.0.11", "10.244.0.12", "10.244.0.13"]);
    // .12 goes, .14 comes: .14 takes its number, .11 and .13 keep theirs (in order: .11 .13 .14).
    let mut new = service(&["10.244.0.11", "10.244.0.13", "10.244.0.14"]);
    keep_affinity_slots(&old, &mut new);
    assert_eq!(numbered(&new), ["10.244.0.11", "10.244.0.14", "10.244.0.13"]);
    // Scaled down by one: the last one takes the number of the one that left.
    let mut fewer = service(&["10.244.0.11", "10.244.0.13"]);
    keep_affinity_slots(&new, &mut fewer);
    assert_eq!(numbered(&fewer), ["10.244.0.11", "10.244.0.13"]);
    let mut fewer = service(&["10.244.0.13", "10.244.0.14"]);
    keep_affinity_slots(&new, &mut fewer);
    assert_eq!(numbered(&fewer), ["10.244.0.13", "10.244.0.14"]);
    // Scaled up: the newcomer gets the next number.
    let mut more = service(&["10.244.0.10", "10.244.0.11", "10.244.0.13", "10.244.0.14"]);
    keep_affinity_slots(&new, &mut more);
    assert_eq!(numbered(&more), ["10.244.0.11", "10.244.0.14", "10.244.0.13", "10.244.0.10"]);
    // Without affinity, numbers stay in order.
    let plain = |backends: &[&str]| {
        validate_service_output(
            &key(),
            &ruleset(vec![], backends.iter().map(|b| backend("10.96.0.20", Protocol::Tcp, 80, b, 8080)).collect()),
        )
        .unwrap()
    };
    let mut next = plain(&["10.244.0.11", "10.244.0.13", "10.244.0.14"]);
    keep_affinity_slots(&old, &mut next);
    assert_eq!(numbered(&next), ["10.244.0.11", "10.244.0.13", "10.244.0.14"]);
}

fn container_port(
    protocol: wasmplane_model::Protocol,
    port: u16,
    host_port: Option<u16>,
    host_ip: Option<&str>,
) -> wasmplane_model::ContainerPort {
    wasmplane_model::ContainerPort {
        name: Default::default(),
        protocol,
        port,
        host_port,
        host_ip: host_ip.map(Into::into),
    }
}

/// A pod of node-a with `ips` and `ports`.
fn pod_with(ips: &[&str], ports: Vec<wasmplane_model::ContainerPort>) -> wasmplane_model::Pod {
    wasmplane_model::Pod {
        namespace: "shop".into(),
        name: "ingress".into(),
        ips: ips.iter().map(|ip| (*ip).into()).collect(),
        node_name: Some("node-a".into()),
        labels: Default::default(),
        ports,
        host_network: false,
    }
}

fn elements_of(rules: &ObjectRules) -> Vec<(&str, &str, &str)> {
    rules.elements.iter().map(|((map, key), value)| (map.as_str(), key.as_str(), value.as_str())).collect()
}

#[test]
fn host_ports_are_dnat_elements_per_family_of_a_host_ip_or_any_address_with_the_pods_hairpin_pair() {
    use wasmplane_model::Protocol::{Tcp, Udp};
    let pod = pod_with(
        &["10.244.0.11", "fd00::11"],
        vec![
            container_port(Tcp, 8080, Some(18080), None),
            container_port(Udp, 53, Some(5353), Some("192.168.77.1")),
            container_port(Tcp, 8443, Some(443), Some("2001:db8::10")),
            container_port(Tcp, 9090, None, None),
        ],
    );
    let rules = hostport_rules(&pod, "node-a").unwrap();
    assert_eq!(
        elements_of(&rules),
        vec![
            ("hairpin", "10.244.0.11 . 10.244.0.11", ""),
            ("hairpin6", "fd00::11 . fd00::11", ""),
            ("hostports", "192.168.77.1 . udp . 5353", "10.244.0.11 . 53"),
            ("hostports-any", "tcp . 18080", "10.244.0.11 . 8080"),
            ("hostports-any6", "tcp . 18080", "fd00::11 . 8080"),
            ("hostports6", "2001:db8::10 . tcp . 443", "fd00::11 . 8443"),
        ],
        "a host IP of one family forwards to the pod's address of that family only; a port without host port is not forwarded"
    );
    assert!(rules.chains.is_empty() && rules.sets.is_empty() && !rules.is_sharded(), "data in the main table only");
    assert_eq!(hostport_object_key(&pod.key()), ObjectKey::new("hostport:shop", "ingress"));

    // A full transaction writes them into the main table's maps; the hairpin pair is shared.
    let text = full_transaction([&rules].into_iter(), &Stale::default(), Layout::default(), &NodeNetworks::default());
    let main = "inet wasmplane";
    assert!(has_element(&text, main, "hostports-any", "tcp . 18080 : 10.244.0.11 . 8080"), "{text}");
    assert!(has_element(&text, main, "hostports-any6", "tcp . 18080 : fd00::11 . 8080"), "{text}");
    assert!(has_element(&text, main, "hostports", "192.168.77.1 . udp . 5353 : 10.244.0.11 . 53"), "{text}");
    assert!(has_element(&text, main, "hostports6", "2001:db8::10 . tcp . 443 : fd00::11 . 8443"), "{text}");
    assert!(has_element(&text, main, "hairpin", "10.244.0.11 . 10.244.0.11"), "{text}");
    assert!(is_shared_set("hairpin") && rules.shared_keys().count() == 2);

    // A pod that comes and goes is element statements only, and the netlink writer takes them.
    let mut added = String::new();
    object_delta(&ObjectRules::default(), &rules, &mut added, Layout::default());
    assert!(
        added.contains("add element inet wasmplane hostports-any { tcp . 18080 : 10.244.0.11 . 8080 }\n"),
        "{added}"
    );
    assert!(added.lines().all(|l| l.starts_with("add element inet wasmplane ")), "{added}");
    let mut removed = String::new();
    object_delta(&rules, &ObjectRules::default(), &mut removed, Layout::default());
    assert!(removed.contains("delete element inet wasmplane hostports { 192.168.77.1 . udp . 5353 }\n"), "{removed}");
    for transaction in [&added, &removed] {
        assert!(netlink::encode_transaction(transaction, 1).is_ok(), "{transaction}");
    }
}

#[test]
fn host_ports_need_a_pod_on_this_node_off_the_host_network_with_an_address_of_their_family() {
    use wasmplane_model::Protocol::Tcp;
    let any = || vec![container_port(Tcp, 8080, Some(18080), None)];
    let pod = pod_with(&["10.244.0.11"], any());
    assert!(hostport_rules(&pod, "node-a").is_some());
    assert_eq!(hostport_rules(&pod, "node-b"), None, "another node's pod");
    assert_eq!(
        hostport_rules(&wasmplane_model::Pod { node_name: None, ..pod.clone() }, "node-a"),
        None,
        "a pod not scheduled"
    );
    assert_eq!(
        hostport_rules(&wasmplane_model::Pod { host_network: true, ..pod.clone() }, "node-a"),
        None,
        "the pod listens on the node itself"
    );
    assert_eq!(hostport_rules(&pod_with(&[], any()), "node-a"), None, "no address yet");
    assert_eq!(
        hostport_rules(&pod_with(&["10.244.0.11"], vec![container_port(Tcp, 8080, None, None)]), "node-a"),
        None,
        "no host port"
    );
    let v6_host_ip = vec![container_port(Tcp, 8080, Some(18080), Some("2001:db8::10"))];
    assert_eq!(
        hostport_rules(&pod_with(&["10.244.0.11"], v6_host_ip), "node-a"),
        None,
        "a host IP of a family the pod has no address of"
    );
    let v6_only = hostport_rules(&pod_with(&["fd00::11"], any()), "node-a").unwrap();
    assert_eq!(
        elements_of(&v6_only),
        vec![("hairpin6", "fd00::11 . fd00::11", ""), ("hostports-any6", "tcp . 18080", "fd00::11 . 8080")]
    );
}

#[test]
fn the_skeleton_dnats_host_ports_on_local_addresses_before_the_services() {
    let mut text = String::new();
    skeleton(&mut text, true, Layout::default(), &NodeNetworks::default());
    for line in [
        "add map inet wasmplane hostports { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service; }",
        "add map inet wasmplane hostports-any6 { type inet_proto . inet_service : ipv6_addr . inet_service; }",
        // Declared by `type`: flushed on a full sync, not declared anew (see `TableSkeleton`).
        "flush map inet wasmplane hostports-any",
        "add chain inet wasmplane hostport-prerouting { type nat hook prerouting priority -105; policy accept; }",
        "add chain inet wasmplane hostport-output { type nat hook output priority -105; policy accept; }",
        "add rule inet wasmplane hostport-prerouting jump hostport-dnat",
        "add rule inet wasmplane hostport-output jump hostport-dnat",
        "add rule inet wasmplane hostport-dnat ip daddr . meta l4proto . th dport @hostports fib daddr type local dnat ip to ip daddr . meta l4proto . th dport map @hostports",
        "add rule inet wasmplane hostport-dnat ip daddr != 127.0.0.0/8 meta l4proto . th dport @hostports-any fib daddr type local dnat ip to meta l4proto . th dport map @hostports-any",
        "add rule inet wasmplane hostport-dnat ip6 daddr != ::1 meta l4proto . th dport @hostports-any6 fib daddr type local dnat ip6 to meta l4proto . th dport map @hostports-any6",
        // The services' NAT chains come after (a lower priority runs first).
        "add chain inet wasmplane-s0 nat-prerouting { type nat hook prerouting priority dstnat; policy accept; }",
        "add chain inet wasmplane-s0 nat-output { type nat hook output priority -100; policy accept; }",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
    }
    assert!(!text.contains("delete map inet wasmplane "), "{text}");
    let written = skeleton_chains(Layout::default(), &NodeNetworks::default());
    for chain in ["hostport-prerouting", "hostport-output", "hostport-dnat"] {
        assert!(is_static_chain(chain) && written.contains(&(Table::MAIN, chain.to_string())), "{chain}");
    }
    assert!(HOSTPORT_MAPS.iter().all(|m| is_hostport_map(m) && !is_sharded_map(m) && !is_shared_set(m)));
}

#[test]
fn conntrack_cleanup_of_host_ports_follows_the_pod_and_clears_a_new_udp_port() {
    use wasmplane_model::Protocol::{Tcp, Udp};
    let dns = |ip: &str| {
        hostport_rules(
            &pod_with(
                &[ip],
                vec![container_port(Udp, 53, Some(5353), None), container_port(Tcp, 8080, Some(18080), None)],
            ),
            "node-a",
        )
        .unwrap()
    };
    let none = ObjectRules::default();
    let filter = |endpoint: Option<&str>| ConntrackFilter {
        protocol: "udp",
        ipv6: false,
        destination: None,
        port: 5353,
        endpoint: endpoint.map(|ip| (ip.parse().unwrap(), 53)),
    };
    // Recreated with another address: flows to the old one go.
    assert_eq!(conntrack_cleanup(&dns("10.244.0.11"), &dns("10.244.0.12")), vec![filter(Some("10.244.0.11"))]);
    // A new host port: every UDP flow to the port, as portmap clears them on ADD; TCP is left alone.
    assert_eq!(conntrack_cleanup(&none, &dns("10.244.0.11")), vec![filter(None)]);
    assert_eq!(conntrack_cleanup(&dns("10.244.0.11"), &none), vec![filter(Some("10.244.0.11"))]);
    assert_eq!(conntrack_cleanup(&dns("10.244.0.11"), &dns("10.244.0.11")), vec![]);
    let specific = hostport_rules(
        &pod_with(&["10.244.0.11"], vec![container_port(Udp, 53, Some(5353), Some("192.168.77.1"))]),
        "node-a",
    )
    .unwrap();
    assert_eq!(
        conntrack_cleanup(&none, &specific),
        vec![ConntrackFilter {
            protocol: "udp",
            ipv6: false,
            destination: Some("192.168.77.1".parse().unwrap()),
            port: 5353,
            endpoint: None
        }]
    );
}

/// The main table's rules of `chain` in a rendered transaction, in order.
fn chain_rules<'a>(text: &'a str, chain: &str) -> Vec<&'a str> {
    let prefix = format!("add rule inet wasmplane {chain} ");
    text.lines().filter_map(|l| l.strip_prefix(prefix.as_str())).collect()
}

#[test]
fn service_drops_are_logged_before_their_verdicts_when_a_group_is_given() {
    // Metered per frontend (10/s each, in a dynamic set per family), at most ten times that
    // per rule for the node.
    let log = |family: &str, reason: &str| {
        let set = if family == "ip" { "service-drop-log" } else { "service-drop-log6" };
        format!(
            "update @{set} {{ {family} daddr . meta l4proto . th dport limit rate 10/second burst 20 packets }} limit rate 100/second burst 200 packets log group 1001 prefix \"wasmplane-service {reason}\""
        )
    };
    let networks = NodeNetworks { service_drop_log: Some(policy::VerdictLog::new(1001)), ..Default::default() };
    let mut text = String::new();
    skeleton(&mut text, true, Layout::default(), &networks);
    // Reached by goto from map elements of either family: a rule for each.
    assert_eq!(
        chain_rules(&text, "reject-chain"),
        vec![log("ip", "no-endpoints"), log("ip6", "no-endpoints"), "reject".into()]
    );
    assert_eq!(
        chain_rules(&text, "drop-chain"),
        vec![log("ip", "no-local-endpoints"), log("ip6", "no-local-endpoints"), "drop".into()]
    );
    assert!(text.contains("add chain inet wasmplane drop-chain\n") && is_static_chain("drop-chain"), "{text}");
    for set in ["service-drop-log", "service-drop-log6"] {
        assert!(
            text.contains(&format!("add set inet wasmplane {set} {{ type "))
                && text.contains(&format!("flush set inet wasmplane {set}\n")),
            "{set}:\n{text}"
        );
    }
    let firewall = "ip daddr . meta l4proto . th dport @firewall-ips ip daddr . meta l4proto . th dport . ip saddr != @firewall-allowed";
    let firewall6 = "ip6 daddr . meta l4proto . th dport @firewall-ips6 ip6 daddr . meta l4proto . th dport . ip6 saddr != @firewall-allowed6";
    assert_eq!(
        chain_rules(&text, "firewall-check"),
        vec![
            format!("{firewall} {}", log("ip", "source-range")),
            format!("{firewall} drop"),
            format!("{firewall6} {}", log("ip6", "source-range")),
            format!("{firewall6} drop"),
        ]
    );
    assert_eq!(
        chain_rules(&text, "cluster-ips-check"),
        vec![
            format!("ip daddr @cluster-ips {}", log("ip", "unknown-port")),
            "ip daddr @cluster-ips reject".into(),
            format!("ip6 daddr @cluster-ips6 {}", log("ip6", "unknown-port")),
            "ip6 daddr @cluster-ips6 reject".into(),
            format!("ip daddr @service-cidrs {}", log("ip", "unallocated")),
            "ip daddr @service-cidrs drop".into(),
            format!("ip6 daddr @service-cidrs6 {}", log("ip6", "unallocated")),
            "ip6 daddr @service-cidrs6 drop".into(),
        ]
    );
    // The verdict maps and the shards are as without logging; every reason has its rule.
    assert_eq!(chain_rules(&text, "endpoints-check").len(), 3);
    for reason in service_drops::ServiceDropReason::ALL {
        assert!(
            text.contains(&format!("prefix \"{}\"", service_drops::prefix(reason))),
            "{reason:?} is not logged:\n{text}"
        );
    }
    assert!(!text.lines().any(|l| l.starts_with("add rule inet wasmplane-s0") && l.contains(" log ")), "{text}");
    assert!(!text.contains("log-service-drop"), "a marker left in:\n{text}");

    // Group 0 (no log): the skeleton without a log rule or the drop chain.
    let mut unlogged = String::new();
    skeleton(&mut unlogged, true, Layout::default(), &NodeNetworks::default());
    assert_eq!(chain_rules(&unlogged, "reject-chain"), vec!["reject"]);
    assert_eq!(
        chain_rules(&unlogged, "cluster-ips-check"),
        vec![
            "ip daddr @cluster-ips reject",
            "ip6 daddr @cluster-ips6 reject",
            "ip daddr @service-cidrs drop",
            "ip6 daddr @service-cidrs6 drop"
        ]
    );
    assert_eq!(chain_rules(&unlogged, "firewall-check"), vec![format!("{firewall} drop"), format!("{firewall6} drop")]);
    assert!(
        !unlogged.contains(" log ") && !unlogged.contains("drop-chain") && !unlogged.contains("log-service-drop"),
        "{unlogged}"
    );
    // Logging only adds lines: every line of the unlogged skeleton is there, in order.
    let mut logged_lines = text.lines();
    for line in unlogged.lines() {
        assert!(logged_lines.any(|l| l == line), "{line:?} is missing or out of order with logging");
    }
}

#[test]
fn the_skeletons_chains_are_read_from_what_it_writes() {
    let layout = Layout { shards: 2 };
    let logged = NodeNetworks { service_drop_log: Some(policy::VerdictLog::new(1001)), ..Default::default() };
    for networks in [NodeNetworks::default(), logged] {
        let chains = skeleton_chains(layout, &networks);
        let mut text = String::new();
        skeleton(&mut text, true, layout, &networks);
        // Every chain the skeleton writes a rule into, base chains without their hooks.
        for line in text.lines().filter_map(|l| l.strip_prefix("add rule inet ")) {
            let mut words = line.split(' ');
            let (table, chain) = (Table::parse(words.next().unwrap()).unwrap(), words.next().unwrap().to_string());
            assert!(chains.contains(&(table, chain)), "{line}");
        }
        for (t, chain) in [
            (Table::MAIN, "policy-ingress"),
            (Table::MAIN, "nat-postrouting"),
            (Table::shard(1), "nat-prerouting"),
            (Table::shard(1), "pick-32"),
        ] {
            assert!(chains.contains(&(t, chain.to_string())), "{t} {chain}");
        }
        assert!(chains.iter().all(|(_, chain)| is_static_chain(chain)), "{chains:?}");
        assert_eq!(chains.contains(&(Table::MAIN, "drop-chain".into())), networks.service_drop_log.is_some());
        assert!(!chains.iter().any(|(t, _)| *t == Table::shard(2)));
    }
}

#[test]
fn a_logging_dataplane_sends_no_endpoint_drops_through_the_drop_chain() {
    // The builtin translator's drop: traffic policy Local without a local endpoint.
    let out = ruleset(
        vec![],
        vec![
            element("no-endpoint-services", "203.0.113.7", Verdict::Drop),
            element("no-endpoint-services", "10.96.0.7", Verdict::Reject),
        ],
    );
    let mut rules = validate_service_output(&key(), &out).unwrap();
    let verdicts = |rules: &ObjectRules| rules.elements.values().map(|v| v.to_string()).collect::<Vec<_>>();
    assert_eq!(verdicts(&rules), vec!["goto reject-chain", "drop"], "unchanged without logging");
    service_drops::route_drops_through_log(&mut rules);
    assert_eq!(verdicts(&rules), vec!["goto reject-chain", "goto drop-chain"]);
    assert_eq!(
        Layout { shards: 4 }.element_table("no-endpoint-services", "goto drop-chain", Some("svc/shop/web")),
        Table::MAIN
    );
    let mut text = String::new();
    object_delta(&ObjectRules::default(), &rules, &mut text, Layout::default());
    assert!(
        text.contains("add element inet wasmplane no-endpoint-services { 203.0.113.7 . tcp . 80 : goto drop-chain }"),
        "{text}"
    );
    // The incremental path encodes it as a batch (no detour through nft).
    netlink::encode_transaction(&text, 1).expect("a goto drop-chain element as netlink");
}

#[test]
fn the_reject_drop_and_cluster_ip_checks_encode_as_netlink_but_for_their_metered_log_rules() {
    let networks = NodeNetworks { service_drop_log: Some(policy::VerdictLog::new(1001)), ..Default::default() };
    let mut text = String::new();
    skeleton(&mut text, true, Layout::default(), &networks);
    // The skeleton goes through nft -f ("add table" is no statement of the batch).
    assert!(netlink::encode_transaction(&text, 1).is_err());
    let rules: Vec<String> = ["reject-chain", "drop-chain", "cluster-ips-check"]
        .iter()
        .flat_map(|chain| {
            chain_rules(&text, chain).into_iter().map(move |rule| format!("add rule inet wasmplane {chain} {rule}\n"))
        })
        .collect();
    // The log rules meter per frontend (a dynset with a concatenated key and a limit inside),
    // which only nft writes; only the skeleton, a full sync, holds them.
    let (metered, plain): (Vec<_>, Vec<_>) =
        rules.into_iter().partition(|rule| rule.contains("update @service-drop-log"));
    assert_eq!((metered.len(), plain.len()), (8, 6), "{metered:?} {plain:?}");
    assert!(metered.iter().all(|rule| rule.contains(" log group 1001 ")), "{metered:?}");
    netlink::encode_transaction(&plain.concat(), 1).expect("the verdicts as netlink");
    for rule in &metered {
        assert!(netlink::encode_transaction(rule, 1).is_err(), "{rule}");
    }
}

/// Every detection mode of pod traffic (`--detect-local-mode`), with the matches each
/// renders for IPv4 and IPv6, from pods and not.
fn pod_traffic_modes() -> [(PodTraffic, [&'static str; 4]); 3] {
    [
        (
            PodTraffic::SourceAddress,
            [
                "ip saddr @cluster-cidrs",
                "ip saddr != @cluster-cidrs",
                "ip6 saddr @cluster-cidrs6",
                "ip6 saddr != @cluster-cidrs6",
            ],
        ),
        (
            PodTraffic::InterfacePrefix("veth".into()),
            ["iifname \"veth*\"", "iifname != \"veth*\"", "iifname \"veth*\"", "iifname != \"veth*\""],
        ),
        (
            PodTraffic::Bridge("cbr0".into()),
            ["iifname \"cbr0\"", "iifname != \"cbr0\"", "iifname \"cbr0\"", "iifname != \"cbr0\""],
        ),
    ]
}

fn pod_traffic(family: AddressFamily, negate: bool) -> RuleMatch {
    RuleMatch::PodTraffic(PodTrafficMatch { family, negate })
}

#[test]
fn pod_traffic_matches_render_as_the_node_detects_pod_traffic() {
    let chain = "svc/shop/web/tcp/http";
    let rule = |family, negate, verdict| Rule {
        matches: vec![pod_traffic(family, negate), RuleMatch::Protocol(Protocol::Tcp)],
        statements: vec![],
        verdict,
        comment: None,
    };
    let out = ruleset(
        vec![Chain {
            name: chain.into(),
            rules: vec![
                rule(AddressFamily::Ipv4, false, Verdict::Accept),
                rule(AddressFamily::Ipv4, true, Verdict::Masquerade),
                rule(AddressFamily::Ipv6, false, Verdict::Accept),
                rule(AddressFamily::Ipv6, true, Verdict::Masquerade),
            ],
        }],
        vec![],
    );
    for (mode, [v4, not_v4, v6, not_v6]) in pod_traffic_modes() {
        let rules = super::validate_service_output(&key(), &out, PodDetection::new(&mode, &dual_stack())).unwrap();
        assert_eq!(
            rules.chains[chain],
            vec![
                format!("{v4} meta l4proto tcp accept"),
                format!("{not_v4} meta l4proto tcp jump mark-for-masquerade"),
                format!("{v6} meta l4proto tcp accept"),
                format!("{not_v6} meta l4proto tcp jump mark-for-masquerade"),
            ],
            "{mode:?}"
        );
        // The incremental path sends them as a netlink batch, not through nft -f.
        let mut text = String::new();
        object_delta(&ObjectRules::default(), &rules, &mut text, Layout::default());
        netlink::encode_transaction(&text, 1).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    }
}

/// By source address a family without a cluster CIDR has no pod detector: a rule matching
/// its pod traffic, from pods or not, is left out whole (kube-proxy writes none, and
/// `!= @cluster-cidrs6` over an empty set would match every packet); the chain's other rules
/// stay. By interface every family has a detector: nothing is left out.
#[test]
fn pod_traffic_rules_of_a_family_without_a_detector_are_left_out() {
    let chain = "svc/shop/web/tcp/http";
    let rule = |family, negate, verdict| Rule {
        matches: vec![pod_traffic(family, negate), RuleMatch::Protocol(Protocol::Tcp)],
        statements: vec![],
        verdict,
        comment: None,
    };
    let out = ruleset(
        vec![
            Chain {
                name: chain.into(),
                rules: vec![
                    rule(AddressFamily::Ipv4, true, Verdict::Masquerade),
                    rule(AddressFamily::Ipv6, true, Verdict::Masquerade),
                    rule(AddressFamily::Ipv6, false, Verdict::Goto("svc/shop/web/tcp/http/local".into())),
                    dnat_chain(chain, "10.244.0.11").rules.remove(0),
                ],
            },
            dnat_chain("svc/shop/web/tcp/http/local", "10.244.0.11"),
        ],
        vec![],
    );
    let rendered = |mode: &PodTraffic, cidrs: &[IpNet]| {
        super::validate_service_output(&key(), &out, PodDetection::new(mode, cidrs)).unwrap().chains[chain].clone()
    };
    let v4_only: Vec<IpNet> = vec!["10.244.0.0/16".parse().unwrap()];
    let v6_only: Vec<IpNet> = vec!["fd00:10::/48".parse().unwrap()];
    let source = PodTraffic::SourceAddress;
    assert_eq!(
        rendered(&source, &v4_only),
        [
            "ip saddr != @cluster-cidrs meta l4proto tcp jump mark-for-masquerade",
            "meta l4proto tcp dnat ip to 10.244.0.11:8080"
        ]
    );
    assert_eq!(
        rendered(&source, &v6_only),
        [
            "ip6 saddr != @cluster-cidrs6 meta l4proto tcp jump mark-for-masquerade",
            "ip6 saddr @cluster-cidrs6 meta l4proto tcp goto svc/shop/web/tcp/http/local",
            "meta l4proto tcp dnat ip to 10.244.0.11:8080"
        ]
    );
    assert_eq!(rendered(&source, &[]), ["meta l4proto tcp dnat ip to 10.244.0.11:8080"]);
    assert_eq!(rendered(&source, &dual_stack()).len(), 4);
    for mode in [PodTraffic::InterfacePrefix("veth".into()), PodTraffic::Bridge("cbr0".into())] {
        for cidrs in [&v4_only[..], &v6_only, &[]] {
            assert_eq!(rendered(&mode, cidrs).len(), 4, "{mode:?} with {cidrs:?}");
        }
    }
    // Left out, not unchecked: the rule is validated all the same.
    let mut bad = out.clone();
    bad.chains[0].rules[1].verdict = Verdict::Goto("svc/shop/web/nowhere".into());
    assert!(
        super::validate_service_output(&key(), &bad, PodDetection::new(&source, &v4_only))
            .unwrap_err()
            .reason
            .contains("does not declare")
    );
}

/// The skeleton's off-cluster masquerade of a family without a pod detector (by source
/// address, no cluster CIDR of it) is no rule: kube-proxy masquerades nothing then, where
/// `ip6 saddr != @cluster-cidrs6` over an empty set would masquerade pods too. By
/// interface it is there in both families, with a cluster CIDR or not.
#[test]
fn the_skeleton_masquerades_off_cluster_sources_only_where_pods_are_detected() {
    let masquerade_checks = |pod_traffic: PodTraffic, cluster_cidrs: Vec<IpNet>| -> Vec<String> {
        let networks = NodeNetworks { pod_traffic, cluster_cidrs, ..Default::default() };
        let text =
            full_transaction(std::iter::empty::<&ObjectRules>(), &Stale::default(), Layout { shards: 2 }, &networks);
        let of_shard = |shard: &str| -> Vec<String> {
            let prefix = format!("add rule inet {shard} masquerade-check ");
            text.lines()
                .filter_map(|l| l.strip_prefix(prefix.as_str()))
                .filter(|r| r.contains("@masquerade-off-cluster"))
                .map(str::to_string)
                .collect()
        };
        let rules = of_shard("wasmplane-s0");
        assert_eq!(rules, of_shard("wasmplane-s1"), "every shard alike");
        rules
    };
    let v4 = |rest: &str| {
        format!("ip daddr . meta l4proto . th dport @masquerade-off-cluster {rest} jump mark-for-masquerade")
    };
    let v6 = |rest: &str| {
        format!("ip6 daddr . meta l4proto . th dport @masquerade-off-cluster6 {rest} jump mark-for-masquerade")
    };
    let (v4_only, v6_only): (Vec<IpNet>, Vec<IpNet>) =
        (vec!["10.244.0.0/16".parse().unwrap()], vec!["fd00:10::/48".parse().unwrap()]);
    assert_eq!(masquerade_checks(PodTraffic::SourceAddress, v4_only.clone()), [v4("ip saddr != @cluster-cidrs")]);
    assert_eq!(masquerade_checks(PodTraffic::SourceAddress, v6_only.clone()), [v6("ip6 saddr != @cluster-cidrs6")]);
    assert_eq!(masquerade_checks(PodTraffic::SourceAddress, vec![]), Vec::<String>::new());
    for cidrs in [v4_only, v6_only, vec![]] {
        assert_eq!(
            masquerade_checks(PodTraffic::InterfacePrefix("vp".into()), cidrs.clone()),
            [v4("iifname != \"vp*\""), v6("iifname != \"vp*\"")],
            "{cidrs:?}"
        );
        assert_eq!(
            masquerade_checks(PodTraffic::Bridge("cbr0".into()), cidrs.clone()),
            [v4("iifname != \"cbr0\""), v6("iifname != \"cbr0\"")],
            "{cidrs:?}"
        );
    }
}

#[test]
fn the_skeleton_masquerades_off_cluster_sources_as_the_node_detects_pod_traffic() {
    let cidrs = dual_stack();
    for (mode, [_, not_v4, _, not_v6]) in pod_traffic_modes() {
        let networks = NodeNetworks { pod_traffic: mode.clone(), cluster_cidrs: cidrs.clone(), ..Default::default() };
        let text =
            full_transaction(std::iter::empty::<&ObjectRules>(), &Stale::default(), Layout { shards: 2 }, &networks);
        for shard in ["inet wasmplane-s0", "inet wasmplane-s1"] {
            let prefix = format!("add rule {shard} masquerade-check ");
            // In any order: each rule only jumps to mark-for-masquerade.
            let mut rules: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(prefix.as_str())).collect();
            rules.sort();
            let mut wanted = vec![
                "ip daddr . meta l4proto . th dport @masquerade-always jump mark-for-masquerade".to_string(),
                "ip6 daddr . meta l4proto . th dport @masquerade-always6 jump mark-for-masquerade".to_string(),
                format!("ip daddr . meta l4proto . th dport @masquerade-off-cluster {not_v4} jump mark-for-masquerade"),
                format!(
                    "ip6 daddr . meta l4proto . th dport @masquerade-off-cluster6 {not_v6} jump mark-for-masquerade"
                ),
            ];
            wanted.sort();
            assert_eq!(rules, wanted, "{mode:?} in {shard}");
        }
        // Interfaces are no source addresses: nothing looks the sets up by interface.
        assert_eq!(text.contains("@cluster-cidrs"), mode.is_source_address(), "{mode:?}");
        // Each table declares and fills the cluster-cidrs sets, the main one too (for
        // policies' pod-traffic matches), whatever the mode.
        for t in ["inet wasmplane", "inet wasmplane-s0", "inet wasmplane-s1"] {
            for line in [
                format!("add set {t} cluster-cidrs {{ type ipv4_addr; flags interval; }}"),
                format!("add set {t} cluster-cidrs6 {{ type ipv6_addr; flags interval; }}"),
                format!("add element {t} cluster-cidrs {{ 10.244.0.0/16 }}"),
                format!("add element {t} cluster-cidrs6 {{ fd00:10::/48 }}"),
            ] {
                assert!(text.lines().any(|l| l == line), "{mode:?}: missing {line:?} in\n{text}");
            }
        }
    }
}

#[test]
fn a_frontend_or_a_node_port_is_claimed_whole_across_the_maps_keyed_by_it() {
    let claim_of = |map: &str, key: &str| claim(&(map.into(), key.into())).to_string();
    let (v4, v6, node_port) = ("frontend 10.96.0.1 . tcp . 80", "frontend fd00::1 . udp . 53", "node port tcp . 30080");
    for (map, key, claimed) in [
        ("service-ips", "10.96.0.1 . tcp . 80", v4),
        ("no-endpoint-services", "10.96.0.1 . tcp . 80", v4),
        ("masquerade-off-cluster", "10.96.0.1 . tcp . 80", v4),
        ("masquerade-always", "10.96.0.1 . tcp . 80", v4),
        ("frontends-3", "10.96.0.1 . tcp . 80", v4),
        ("service-endpoints", "10.96.0.1 . tcp . 80 . 2", v4),
        ("service-ips6", "fd00::1 . udp . 53", v6),
        ("no-endpoint-services6", "fd00::1 . udp . 53", v6),
        ("frontends6-12", "fd00::1 . udp . 53", v6),
        ("service-endpoints6", "fd00::1 . udp . 53 . 11", v6),
        ("service-nodeports", "tcp . 30080", node_port),
        ("no-endpoint-nodeports", "tcp . 30080", node_port),
        ("nodeport-picks6", "tcp . 30080", node_port),
        ("nodeports-1", "tcp . 30080", node_port),
        ("nodeport-endpoints", "tcp . 30080 . 0", node_port),
    ] {
        assert_eq!(claim_of(map, key), claimed, "{map}");
    }
    // Another port or address is another frontend; other maps claim the element itself.
    assert_ne!(claim_of("service-ips", "10.96.0.1 . tcp . 81"), claim_of("service-ips", "10.96.0.1 . tcp . 80"));
    assert_eq!(claim_of("cluster-ips", "10.96.0.1"), "cluster-ips { 10.96.0.1 }");
    assert_eq!(claim_of("firewall-ips", "10.96.0.1 . tcp . 80"), "firewall-ips { 10.96.0.1 . tcp . 80 }");
    assert_eq!(claim_of("frontends-x", "10.96.0.1 . tcp . 80"), "frontends-x { 10.96.0.1 . tcp . 80 }");
}
