use super::*;

fn ctx() -> NodeContext {
    NodeContext {
        node_name: "node-a".into(),
        node_ips: vec!["192.168.0.1".into()],
        cluster_cidrs: vec!["10.244.0.0/16".into()],
        pod_cidrs: vec![],
    }
}

fn service() -> Service {
    Service {
        namespace: "shop".into(),
        name: "web".into(),
        service_type: ServiceType::ClusterIp,
        cluster_ips: vec!["10.96.0.20".into()],
        external_ips: vec![],
        load_balancer_ips: vec![],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: 0,
            target_port: TargetPort::Number(8080),
        }],
        session_affinity_timeout: None,
        external_traffic_policy: TrafficPolicy::Cluster,
        internal_traffic_policy: TrafficPolicy::Cluster,
        labels: vec![],
    }
}

fn endpoint(ip: &str, ready: bool, terminating: bool, local: bool) -> Endpoint {
    Endpoint {
        addresses: vec![ip.into()],
        ready,
        serving: ready || terminating,
        terminating,
        node_name: None,
        zone: None,
        is_local: local,
    }
}

fn slice(endpoints: Vec<Endpoint>) -> EndpointSlice {
    EndpointSlice {
        name: "web-1".into(),
        endpoints,
        ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
    }
}

/// Where the service DNATs to: in its chains, or as backends in the host's map.
fn dnat_targets(r: &Ruleset) -> Vec<String> {
    let in_chains = r.chains.iter().flat_map(|c| &c.rules).flat_map(|rule| &rule.statements).filter_map(|s| match s {
        RuleStatement::Dnat(t) => Some(format!("{}:{}", t.address, t.port)),
        _ => None,
    });
    let as_data = r.map_elements.iter().filter(|e| e.map_name == "service-backends").filter_map(|e| match &e.key[..] {
        [_, _, _, KeyPart::Address(a), KeyPart::Port(p)] => Some(format!("{a}:{p}")),
        _ => None,
    });
    let mut v: Vec<String> = in_chains.chain(as_data).collect();
    v.sort();
    v.dedup();
    v
}

fn elements<'a>(r: &'a Ruleset, map: &str) -> Vec<&'a [KeyPart]> {
    r.map_elements.iter().filter(|e| e.map_name == map).map(|e| &e.key[..]).collect()
}

#[test]
fn cluster_ip_picks_uniformly_among_ready_endpoints() {
    let eps = slice(vec![
        endpoint("10.244.0.11", true, false, true),
        endpoint("10.244.1.11", true, false, false),
        endpoint("10.244.1.12", false, false, false),
    ]);
    let r = translate(&ctx(), "svc/shop/web", &service(), &[eps]).unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(dnat_targets(&r), vec!["10.244.0.11:8080", "10.244.1.11:8080"]);
    // No chain at all (every kernel commit walks every chain): the backends as data, the
    // host picks among them; off-cluster sources are masqueraded.
    assert!(r.chains.is_empty(), "{:?}", r.chains);
    let frontend = [KeyPart::Address("10.96.0.20".into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    let backend = |ip: &str| [&frontend[..], &[KeyPart::Address(ip.into()), KeyPart::Port(8080)]].concat();
    assert_eq!(elements(&r, "service-backends"), vec![&backend("10.244.0.11")[..], &backend("10.244.1.11")[..]]);
    assert_eq!(elements(&r, "masquerade-off-cluster"), vec![&frontend[..]]);
    assert!(elements(&r, "service-ips").is_empty() && elements(&r, "masquerade-always").is_empty());
    // The cluster IP itself, for the host's reject of ports the service does not define.
    let cluster_ip = MapElement {
        map_name: "cluster-ips".into(),
        key: vec![KeyPart::Address("10.96.0.20".into())],
        verdict: Verdict::None,
    };
    assert!(r.map_elements.contains(&cluster_ip), "{:?}", r.map_elements);
    // Each endpoint once, for the host's hairpin masquerade.
    let hairpin: Vec<&MapElement> = r.map_elements.iter().filter(|e| e.map_name == "hairpin").collect();
    assert!(hairpin.iter().all(|e| e.verdict == Verdict::None), "{hairpin:?}");
    assert_eq!(
        hairpin.iter().map(|e| e.key.clone()).collect::<Vec<_>>(),
        vec![vec![KeyPart::Address("10.244.0.11".into())], vec![KeyPart::Address("10.244.1.11".into())],]
    );
}

#[test]
fn more_backends_than_the_host_picks_among_get_a_chain_that_draws_and_dnats() {
    let many: Vec<Endpoint> =
        (0..=MAX_BACKENDS_PER_FRONTEND).map(|i| endpoint(&format!("10.244.2.{i}"), true, false, false)).collect();
    let r = translate(&ctx(), "svc/shop/web", &service(), &[slice(many)]).unwrap();
    assert!(elements(&r, "service-backends").is_empty());
    assert_eq!(r.chains.len(), 1, "one chain, no chain per endpoint");
    let svc_chain = &r.chains[0];
    assert_eq!(svc_chain.name, "svc/shop/web/tcp/http");
    // Masquerade sources not from pods (as the host detects them), then 1/33, 1/32, ... and
    // the rest, each DNATing.
    assert_eq!(svc_chain.rules[0].verdict, Verdict::Masquerade);
    assert_eq!(
        svc_chain.rules[0].matches,
        vec![
            RuleMatch::Destination(AddressMatch { cidr: "10.96.0.20".into(), negate: false }),
            RuleMatch::Protocol(Protocol::Tcp),
            RuleMatch::DestinationPort(80),
            pod_traffic(AddressFamily::Ipv4, true),
        ]
    );
    let n = MAX_BACKENDS_PER_FRONTEND as u32 + 1;
    assert_eq!(svc_chain.rules[1].matches, vec![RuleMatch::Random((n, 0)), RuleMatch::Protocol(Protocol::Tcp)]);
    assert_eq!(svc_chain.rules.last().unwrap().matches, vec![RuleMatch::Protocol(Protocol::Tcp)]);
    assert!(
        svc_chain.rules[1..]
            .iter()
            .all(|rule| rule.verdict == Verdict::None && matches!(rule.statements[..], [RuleStatement::Dnat(_)]))
    );
    assert_eq!(dnat_targets(&r).len(), n as usize);
    assert_eq!(elements(&r, "service-ips").len(), 1);
}

fn pod_traffic(family: AddressFamily, negate: bool) -> RuleMatch {
    RuleMatch::PodTraffic(PodTrafficMatch { family, negate })
}

/// A port kept in chains (externalTrafficPolicy Local with an external IP) of `cluster_ip`'s family.
fn local_external_service(cluster_ip: &str, external_ip: &str) -> Service {
    let mut svc = service();
    svc.cluster_ips = vec![cluster_ip.into()];
    svc.external_ips = vec![external_ip.into()];
    svc.external_traffic_policy = TrafficPolicy::Local;
    svc
}

fn chain<'a>(r: &'a Ruleset, name: &str) -> &'a Chain {
    r.chains.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no chain {name}: {:?}", r.chains))
}

#[test]
fn pods_are_told_by_the_host_in_one_rule_however_many_cluster_cidrs() {
    let mut node = ctx();
    node.cluster_cidrs = vec!["10.244.0.0/16".into(), "10.245.0.0/16".into(), "fd00:10:244::/56".into()];
    let eps = slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.245.0.12", true, false, false)]);
    let r = translate(&node, "svc/shop/web", &local_external_service("10.96.0.20", "203.0.113.7"), &[eps]).unwrap();
    // The cluster chain: one masquerade of what does not come from pods (of the chain's
    // family), before the pick; no rule per cluster CIDR.
    let service_chain = chain(&r, "svc/shop/web/tcp/http");
    assert_eq!(
        service_chain.rules.iter().filter(|rule| rule.verdict == Verdict::Masquerade).count(),
        1,
        "{:?}",
        service_chain.rules
    );
    assert_eq!(service_chain.rules[0].verdict, Verdict::Masquerade);
    assert_eq!(
        service_chain.rules[0].matches,
        vec![
            RuleMatch::Destination(AddressMatch { cidr: "10.96.0.20".into(), negate: false }),
            RuleMatch::Protocol(Protocol::Tcp),
            RuleMatch::DestinationPort(80),
            pod_traffic(AddressFamily::Ipv4, true),
        ]
    );
    assert_eq!(service_chain.rules.len(), 1 + 2, "the masquerade and a rule per endpoint");
    // The external chain: pods to the cluster chain in one rule, everything else to a local endpoint.
    let external = chain(&r, "svc/shop/web/tcp/http/external");
    assert_eq!(external.rules.len(), 2, "{:?}", external.rules);
    assert_eq!(external.rules[0].matches, vec![pod_traffic(AddressFamily::Ipv4, false)]);
    assert_eq!(external.rules[0].verdict, Verdict::Goto("svc/shop/web/tcp/http".into()));
    assert!(external.rules[1].matches.is_empty(), "{:?}", external.rules[1]);
    assert_eq!(external.rules[1].verdict, Verdict::Goto("svc/shop/web/tcp/http/local".into()));
    // Nothing matches a cluster CIDR itself.
    let matches = || r.chains.iter().flat_map(|c| &c.rules).flat_map(|rule| &rule.matches);
    assert!(matches().all(|m| !matches!(m, RuleMatch::Source(_))), "{:?}", r.chains);
}

/// The pod-traffic rules are always of the chain's family, whatever cluster CIDRs the node
/// context has: where the node cannot detect pods in the family (by source address, no
/// cluster CIDR of it) the host leaves them out, as kube-proxy without a detector; by
/// interface it detects pods in every family, with no CIDR at all.
#[test]
fn pod_traffic_is_always_of_the_chains_family() {
    let svc = local_external_service("fd00:96::20", "2001:db8::7");
    let eps = [slice(vec![endpoint("fd00:10:244::11", true, false, true)])];
    let mut dual_stack = ctx();
    dual_stack.cluster_cidrs.push("fd00:10:244::/56".into());
    let mut none = ctx();
    none.cluster_cidrs.clear();
    // Only an IPv4 cluster CIDR (an interface mode's `--cluster-cidr` on a dual-stack node),
    // both, or none: the same IPv6 rules.
    let r = translate(&ctx(), "svc/shop/web", &svc, &eps).unwrap();
    assert_eq!(translate(&dual_stack, "svc/shop/web", &svc, &eps).unwrap(), r);
    assert_eq!(translate(&none, "svc/shop/web", &svc, &eps).unwrap(), r);
    let service_chain = chain(&r, "svc/shop/web/tcp/http");
    assert_eq!(service_chain.rules[0].verdict, Verdict::Masquerade);
    assert_eq!(
        service_chain.rules[0].matches,
        vec![
            RuleMatch::Destination(AddressMatch { cidr: "fd00:96::20".into(), negate: false }),
            RuleMatch::Protocol(Protocol::Tcp),
            RuleMatch::DestinationPort(80),
            pod_traffic(AddressFamily::Ipv6, true),
        ]
    );
    assert_eq!(service_chain.rules.len(), 2, "the masquerade and the endpoint's DNAT: {:?}", service_chain.rules);
    let external = chain(&r, "svc/shop/web/tcp/http/external");
    assert_eq!(external.rules[0].matches, vec![pod_traffic(AddressFamily::Ipv6, false)]);
    assert_eq!(external.rules[0].verdict, Verdict::Goto("svc/shop/web/tcp/http".into()));
    assert_eq!(external.rules.len(), 2);
}

/// As data, every cluster IP with backends is masqueraded off the cluster, of either family
/// and whatever the node context's cluster CIDRs (the host's `masquerade-off-cluster6` for
/// an IPv6 one; the host masquerades none of a family it cannot detect pods in).
#[test]
fn cluster_ips_of_both_families_are_masqueraded_off_the_cluster() {
    let mut svc = service();
    svc.cluster_ips = vec!["10.96.0.20".into(), "fd00:96::20".into()];
    let v4 = slice(vec![endpoint("10.244.0.11", true, false, true)]);
    let mut v6 = slice(vec![endpoint("fd00:10:244::11", true, false, true)]);
    v6.name = "web-2".into();
    let frontend = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    let mut none = ctx();
    none.cluster_cidrs.clear();
    for node in [ctx(), none] {
        let r = translate(&node, "svc/shop/web", &svc, &[v4.clone(), v6.clone()]).unwrap();
        assert!(r.chains.is_empty(), "{:?}", r.chains);
        assert_eq!(
            elements(&r, "masquerade-off-cluster"),
            vec![&frontend("10.96.0.20")[..], &frontend("fd00:96::20")[..]],
            "{:?}",
            node.cluster_cidrs
        );
    }
}

#[test]
fn node_ports_and_external_ips_as_data_are_masqueraded() {
    let mut svc = service();
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    svc.external_ips = vec!["203.0.113.7".into()];
    let r =
        translate(&ctx(), "svc/shop/web", &svc, &[slice(vec![endpoint("10.244.0.11", true, false, true)])]).unwrap();
    let external = [KeyPart::Address("203.0.113.7".into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    assert_eq!(elements(&r, "masquerade-always"), vec![&external[..]]);
    assert_eq!(elements(&r, "service-backends").len(), 2, "the cluster IP and the external IP");
    // The node port as data too: its backends in `nodeport-backends`, no chain, no element
    // of `service-nodeports` (the host writes that one).
    assert!(r.chains.is_empty(), "{:?}", r.chains);
    let node_port = [
        KeyPart::Protocol(Protocol::Tcp),
        KeyPart::Port(30080),
        KeyPart::Address("10.244.0.11".into()),
        KeyPart::Port(8080),
    ];
    assert_eq!(elements(&r, "nodeport-backends"), vec![&node_port[..]]);
    assert!(elements(&r, "service-nodeports").is_empty());
}

#[test]
fn a_dual_stack_node_port_names_the_backends_of_both_families() {
    let mut svc = service();
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    svc.cluster_ips = vec!["10.96.0.20".into(), "fd00:96::20".into()];
    let v4 = slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.244.1.11", false, false, false)]);
    let mut v6 = slice(vec![endpoint("fd00::11", true, false, true)]);
    v6.name = "web-2".into();
    let r = translate(&ctx(), "svc/shop/web", &svc, &[v4, v6]).unwrap();
    let backends: Vec<String> = elements(&r, "nodeport-backends")
        .iter()
        .map(|k| match k {
            [KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(30080), KeyPart::Address(a), KeyPart::Port(8080)] => {
                a.clone()
            }
            other => panic!("unexpected key {other:?}"),
        })
        .collect();
    assert_eq!(backends, vec!["10.244.0.11", "fd00::11"], "ready endpoints of each family");
    assert!(r.chains.is_empty());
}

#[test]
fn an_endpoint_behind_several_ports_is_one_hairpin_element() {
    let mut svc = service();
    svc.ports.push(ServicePort {
        name: "admin".into(),
        protocol: Protocol::Udp,
        port: 81,
        node_port: 0,
        target_port: TargetPort::Number(9090),
    });
    let mut eps = slice(vec![endpoint("10.244.0.11", true, false, true)]);
    eps.ports.push(EndpointPort { name: "admin".into(), protocol: Protocol::Udp, port: 9090 });
    let r = translate(&ctx(), "svc/shop/web", &svc, &[eps]).unwrap();
    assert_eq!(dnat_targets(&r), vec!["10.244.0.11:8080", "10.244.0.11:9090"]);
    assert_eq!(r.map_elements.iter().filter(|e| e.map_name == "hairpin").count(), 1, "{:?}", r.map_elements);
}

#[test]
fn no_endpoints_rejects_and_terminating_are_a_fallback() {
    let r = translate(&ctx(), "svc/shop/web", &service(), &[]).unwrap();
    assert!(r.chains.is_empty());
    assert_eq!(r.map_elements[0].map_name, "no-endpoint-services");
    assert!(matches!(r.map_elements[0].verdict, Verdict::Reject));

    let only_terminating = slice(vec![endpoint("10.244.0.11", false, true, true)]);
    let r = translate(&ctx(), "svc/shop/web", &service(), &[only_terminating]).unwrap();
    assert_eq!(dnat_targets(&r), vec!["10.244.0.11:8080"]);

    let mixed = slice(vec![endpoint("10.244.0.11", false, true, true), endpoint("10.244.0.12", true, false, true)]);
    let r = translate(&ctx(), "svc/shop/web", &service(), &[mixed]).unwrap();
    assert_eq!(dnat_targets(&r), vec!["10.244.0.12:8080"], "terminating only when nothing is ready");
}

/// Names of the maps of session affinity as data the ruleset has elements of.
fn affinity_maps(r: &Ruleset) -> Vec<&str> {
    let mut v: Vec<&str> = r
        .map_elements
        .iter()
        .map(|e| e.map_name.as_str())
        .filter(|m| m.starts_with("session-affinity-") || m.starts_with("nodeport-affinity-"))
        .collect();
    v.dedup();
    v
}

#[test]
fn session_affinity_in_a_chain_declares_sets_and_checks_them_first() {
    // externalTrafficPolicy Local with an external IP keeps the port in chains; the chains
    // keep the affinity themselves.
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    svc.external_ips = vec!["203.0.113.7".into()];
    svc.external_traffic_policy = TrafficPolicy::Local;
    let eps = slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.244.0.12", true, false, true)]);
    let r = translate(&ctx(), "svc/shop/web", &svc, &[eps]).unwrap();
    // One set per endpoint, though both the cluster chain and the local chain draw it.
    assert_eq!(r.sets.len(), 2);
    assert!(r.sets.iter().all(|s| s.timeout_seconds == Some(10800) && s.name.starts_with("svc/shop/web/")));
    // No chain per endpoint (every kernel commit walks every chain).
    let names: Vec<&str> = r.chains.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, vec!["svc/shop/web/tcp/http", "svc/shop/web/tcp/http/local", "svc/shop/web/tcp/http/external"]);
    // Remembered clients back to their endpoint, each recording the client again (the
    // timeout restarts), then the draw, which records too.
    let set = |ip: &str| format!("svc/shop/web/tcp/http/ep/{ip}/8080/affinity");
    let check = |rules: &[Rule]| {
        assert_eq!(rules.len(), 4, "{rules:?}");
        let (returning, drawn) = (&rules[0..2], &rules[2..4]);
        for (rule, ip) in returning.iter().zip(["10.244.0.11", "10.244.0.12"]) {
            assert!(matches!(&rule.matches[0], RuleMatch::SourceInSet(s) if *s == set(ip)), "{rule:?}");
            let [RuleStatement::AddSourceToSet(u), RuleStatement::Dnat(t)] = &rule.statements[..] else {
                panic!("{rule:?}")
            };
            assert!(u.set == set(ip) && u.timeout_seconds == Some(10800) && t.address == ip, "{rule:?}");
        }
        assert!(matches!(drawn[0].matches[0], RuleMatch::Random((2, 0))), "{:?}", drawn[0]);
        for (rule, ip) in drawn.iter().zip(["10.244.0.11", "10.244.0.12"]) {
            let [RuleStatement::AddSourceToSet(u), RuleStatement::Dnat(t)] = &rule.statements[..] else {
                panic!("{rule:?}")
            };
            assert!(u.set == set(ip) && t.address == ip, "{rule:?}");
        }
    };
    // The cluster chain after its masquerade of sources not from pods, and the local chain.
    assert_eq!(r.chains[0].rules[0].verdict, Verdict::Masquerade);
    assert_eq!(r.chains[0].rules[0].matches.last(), Some(&pod_traffic(AddressFamily::Ipv4, true)));
    check(&r.chains[0].rules[1..]);
    check(&r.chains[1].rules);
    assert_eq!(r.map_elements.iter().filter(|e| e.map_name == "hairpin").count(), 2);
    // Nothing as data: the host's affinity maps are for frontends in `service-backends`.
    assert!(elements(&r, "service-backends").is_empty());
    assert!(affinity_maps(&r).is_empty(), "{:?}", r.map_elements);
}

#[test]
fn session_affinity_with_too_many_backends_stays_in_the_chain() {
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    let many: Vec<Endpoint> =
        (0..=MAX_BACKENDS_PER_FRONTEND).map(|i| endpoint(&format!("10.244.2.{i}"), true, false, false)).collect();
    let r = translate(&ctx(), "svc/shop/web", &svc, &[slice(many)]).unwrap();
    let n = MAX_BACKENDS_PER_FRONTEND + 1;
    assert_eq!(r.chains.len(), 1);
    assert_eq!(r.sets.len(), n);
    // The masquerade rule, a returning rule and a drawing rule per endpoint.
    assert_eq!(r.chains[0].rules.len(), 1 + 2 * n);
    assert!(elements(&r, "service-backends").is_empty() && affinity_maps(&r).is_empty());
}

#[test]
fn session_affinity_on_cluster_ips_is_data_one_element_per_frontend() {
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    svc.cluster_ips = vec!["10.96.0.20".into(), "fd00:96::20".into()];
    let v4 = slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.244.1.11", true, false, false)]);
    let mut v6 = slice(vec![endpoint("fd00::11", true, false, true)]);
    v6.name = "web-2".into();
    let r = translate(&ctx(), "svc/shop/web", &svc, &[v4, v6]).unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    // No chain, no set of clients: the host remembers them.
    assert!(r.chains.is_empty(), "{:?}", r.chains);
    assert!(r.sets.is_empty(), "{:?}", r.sets);
    let frontend = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    let backend = |f: &str, b: &str| [frontend(f), vec![KeyPart::Address(b.into()), KeyPart::Port(8080)]].concat();
    assert_eq!(
        elements(&r, "service-backends"),
        vec![
            &backend("10.96.0.20", "10.244.0.11")[..],
            &backend("10.96.0.20", "10.244.1.11")[..],
            &backend("fd00:96::20", "fd00::11")[..],
        ]
    );
    // Exactly one affinity element per frontend, of each family's cluster IP.
    assert_eq!(elements(&r, "session-affinity-10800"), vec![&frontend("10.96.0.20")[..], &frontend("fd00:96::20")[..]]);
    assert!(
        r.map_elements.iter().filter(|e| e.map_name == "session-affinity-10800").all(|e| e.verdict == Verdict::None)
    );
    assert_eq!(affinity_maps(&r), vec!["session-affinity-10800"], "no node port, no other timeout");
    assert_eq!(r.map_elements.iter().filter(|e| e.map_name == "hairpin").count(), 3);
}

#[test]
fn session_affinity_on_a_node_port_is_data_too() {
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    svc.external_ips = vec!["203.0.113.7".into()];
    let r =
        translate(&ctx(), "svc/shop/web", &svc, &[slice(vec![endpoint("10.244.0.11", true, false, true)])]).unwrap();
    assert!(r.chains.is_empty() && r.sets.is_empty(), "{:?} {:?}", r.chains, r.sets);
    let frontend = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    assert_eq!(elements(&r, "session-affinity-10800"), vec![&frontend("10.96.0.20")[..], &frontend("203.0.113.7")[..]]);
    let node_port = [KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(30080)];
    assert_eq!(elements(&r, "nodeport-affinity-10800"), vec![&node_port[..]]);
    assert!(
        r.map_elements.iter().filter(|e| e.map_name == "nodeport-affinity-10800").all(|e| e.verdict == Verdict::None)
    );
    assert_eq!(elements(&r, "nodeport-backends").len(), 1);
}

#[test]
fn frontends_without_backends_get_no_affinity_element() {
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    svc.external_ips = vec!["203.0.113.7".into()];
    let r = translate(&ctx(), "svc/shop/web", &svc, &[]).unwrap();
    assert_eq!(elements(&r, "no-endpoint-services").len(), 2, "the cluster IP and the external IP reject");
    assert_eq!(elements(&r, "no-endpoint-nodeports").len(), 1);
    assert!(affinity_maps(&r).is_empty(), "{:?}", r.map_elements);

    // Dual-stack with endpoints of one family only: the other family's cluster IP rejects,
    // without affinity; the node port has backends, so it has its affinity.
    svc.cluster_ips = vec!["10.96.0.20".into(), "fd00:96::20".into()];
    svc.external_ips = vec![];
    let r =
        translate(&ctx(), "svc/shop/web", &svc, &[slice(vec![endpoint("10.244.0.11", true, false, true)])]).unwrap();
    let frontend = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)];
    assert_eq!(elements(&r, "no-endpoint-services"), vec![&frontend("fd00:96::20")[..]]);
    assert_eq!(elements(&r, "session-affinity-10800"), vec![&frontend("10.96.0.20")[..]]);
    assert_eq!(elements(&r, "nodeport-affinity-10800").len(), 1);

    // internalTrafficPolicy Local with endpoints only elsewhere drops, without affinity.
    let mut svc = service();
    svc.session_affinity_timeout = Some(10800);
    svc.internal_traffic_policy = TrafficPolicy::Local;
    let r =
        translate(&ctx(), "svc/shop/web", &svc, &[slice(vec![endpoint("10.244.1.11", true, false, false)])]).unwrap();
    assert_eq!(
        r.map_elements.iter().find(|e| e.map_name == "no-endpoint-services").map(|e| &e.verdict),
        Some(&Verdict::Drop)
    );
    assert!(affinity_maps(&r).is_empty(), "{:?}", r.map_elements);
}

#[test]
fn the_affinity_timeout_names_the_map() {
    let mut svc = service();
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    let eps = [slice(vec![endpoint("10.244.0.11", true, false, true)])];
    svc.session_affinity_timeout = Some(30);
    let r = translate(&ctx(), "svc/shop/web", &svc, &eps).unwrap();
    assert_eq!(affinity_maps(&r), vec!["session-affinity-30", "nodeport-affinity-30"]);
    // Out of what a valid Service allows: clamped to 1..=86400 seconds.
    svc.session_affinity_timeout = Some(0);
    assert_eq!(
        affinity_maps(&translate(&ctx(), "svc/shop/web", &svc, &eps).unwrap()),
        vec!["session-affinity-1", "nodeport-affinity-1"]
    );
    svc.session_affinity_timeout = Some(86401);
    let r = translate(&ctx(), "svc/shop/web", &svc, &eps).unwrap();
    assert_eq!(affinity_maps(&r), vec!["session-affinity-86400", "nodeport-affinity-86400"]);
    // Without affinity, none.
    svc.session_affinity_timeout = None;
    assert!(affinity_maps(&translate(&ctx(), "svc/shop/web", &svc, &eps).unwrap()).is_empty());
}

#[test]
fn node_port_with_local_policy_uses_only_local_endpoints() {
    let mut svc = service();
    svc.service_type = ServiceType::NodePort;
    svc.ports[0].node_port = 30080;
    svc.external_traffic_policy = TrafficPolicy::Local;
    let r = translate(
        &ctx(),
        "svc/shop/web",
        &svc,
        &[slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.244.1.11", true, false, false)])],
    )
    .unwrap();
    let nodeport = r.map_elements.iter().find(|e| e.map_name == "service-nodeports").unwrap();
    assert_eq!(nodeport.verdict, Verdict::Goto("svc/shop/web/tcp/http/external".into()));
    let local = r.chains.iter().find(|c| c.name == "svc/shop/web/tcp/http/local").unwrap();
    assert_eq!(local.rules.len(), 1, "one local endpoint, no random pick");
    let external = r.chains.iter().find(|c| c.name == "svc/shop/web/tcp/http/external").unwrap();
    assert!(external.rules.iter().all(|rule| !matches!(rule.verdict, Verdict::Masquerade)), "source IP must be kept");
    // Pods reaching the node port go the cluster chain's way, as the host detects them.
    assert_eq!(external.rules[0].matches, vec![pod_traffic(AddressFamily::Ipv4, false)]);
    assert_eq!(external.rules[0].verdict, Verdict::Goto("svc/shop/web/tcp/http".into()));
}

#[test]
fn headless_and_external_name_services_produce_nothing() {
    let mut headless = service();
    headless.cluster_ips = vec!["None".into()];
    assert!(translate(&ctx(), "svc/shop/web", &headless, &[]).unwrap().map_elements.is_empty());
    let mut external = service();
    external.service_type = ServiceType::ExternalName;
    assert!(translate(&ctx(), "svc/shop/web", &external, &[]).unwrap().chains.is_empty());
}

#[test]
fn internal_local_policy_uses_local_endpoints_and_drops_without_them() {
    let mut svc = service();
    svc.internal_traffic_policy = TrafficPolicy::Local;
    let both = slice(vec![endpoint("10.244.0.11", true, false, true), endpoint("10.244.1.11", true, false, false)]);
    let r = translate(&ctx(), "svc/shop/web", &svc, &[both]).unwrap();
    assert_eq!(dnat_targets(&r), vec!["10.244.0.11:8080"]);
    let remote_only = slice(vec![endpoint("10.244.1.11", true, false, false)]);
    let r = translate(&ctx(), "svc/shop/web", &svc, &[remote_only]).unwrap();
    assert_eq!(r.map_elements.len(), 2);
    assert_eq!(r.map_elements[0].map_name, "no-endpoint-services");
    assert_eq!(r.map_elements[0].verdict, Verdict::Drop, "endpoints elsewhere: drop, not reject");
    let r = translate(&ctx(), "svc/shop/web", &svc, &[]).unwrap();
    assert_eq!(r.map_elements[0].verdict, Verdict::Reject, "no endpoints at all: reject");
}

#[test]
fn a_frontend_of_either_family_with_too_many_backends_keeps_the_port_in_a_chain() {
    let mut svc = service();
    svc.cluster_ips = vec!["10.96.0.20".into(), "fd00:96::20".into()];
    let v4 = slice(vec![endpoint("10.244.0.11", true, false, true)]);
    let mut v6 = slice(
        (0..=MAX_BACKENDS_PER_FRONTEND).map(|i| endpoint(&format!("fd00:10:244::{i:x}"), true, false, false)).collect(),
    );
    v6.name = "web-v6".into();
    let r = translate(&ctx(), "svc/shop/web", &svc, &[v4.clone(), v6]).unwrap();
    assert!(
        elements(&r, "service-backends").is_empty(),
        "the host would refuse the v6 frontend's {} backends",
        MAX_BACKENDS_PER_FRONTEND + 1
    );
    assert!(r.chains.iter().any(|c| c.name == "svc/shop/web/tcp/http"));
    // Within the limit, each cluster IP gets the backends of its own family.
    let v6 = slice(vec![endpoint("fd00:10:244::11", true, false, false)]);
    let r = translate(&ctx(), "svc/shop/web", &svc, &[v4, v6]).unwrap();
    let backends: Vec<(String, String)> = r
        .map_elements
        .iter()
        .filter(|e| e.map_name == "service-backends")
        .filter_map(|e| match &e.key[..] {
            [KeyPart::Address(f), _, _, KeyPart::Address(b), _] => Some((f.clone(), b.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        backends,
        vec![
            ("10.96.0.20".to_string(), "10.244.0.11".to_string()),
            ("fd00:96::20".to_string(), "fd00:10:244::11".to_string())
        ]
    );
}

/// The bench's serialized boundary gives the typed translation's ruleset, and a buffer that
/// does not decode is a guest error, not a panic.
#[cfg(feature = "bench-encoded")]
#[test]
fn the_serialized_boundary_translates_the_same_and_refuses_garbage() {
    let slices = [slice(vec![endpoint("10.244.0.11", true, false, true)])];
    let input = encode_inputs(&ctx(), "svc/shop/web", &service(), &slices);
    let decoded = decode_output(&translate_encoded(&input)).unwrap();
    assert_eq!(decoded, translate(&ctx(), "svc/shop/web", &service(), &slices));

    let garbage = decode_output(&translate_encoded(&input[..input.len() / 2])).unwrap();
    let message = garbage.unwrap_err().message;
    assert!(message.starts_with("decoding the input:"), "{message}");
}

/// The typed inputs as the host archives them (`wasmplane_runtime::archived::encode`, from the
/// model).
fn archive_of(node: &NodeContext, prefix: &str, service: &Service, slices: &[EndpointSlice]) -> Vec<u8> {
    use std::net::IpAddr;
    let ips = |l: &[String]| -> Vec<IpAddr> {
        l.iter().filter(|ip| !ip.is_empty() && *ip != "None").map(|ip| ip.parse().unwrap()).collect()
    };
    let nets = |l: &[String]| -> Vec<archived::Net> {
        l.iter()
            .map(|c| {
                let (ip, len) = c.split_once('/').unwrap();
                archived::Net { address: ip.parse().unwrap(), prefix_len: len.parse().unwrap() }
            })
            .collect()
    };
    let protocol = |p: Protocol| match p {
        Protocol::Tcp => archived::Protocol::Tcp,
        Protocol::Udp => archived::Protocol::Udp,
        Protocol::Sctp => archived::Protocol::Sctp,
    };
    let inputs = archived::Inputs {
        node: archived::NodeContext {
            node_name: &node.node_name,
            node_ips: ips(&node.node_ips),
            cluster_cidrs: nets(&node.cluster_cidrs),
            pod_cidrs: nets(&node.pod_cidrs),
        },
        chain_prefix: prefix,
        service: archived::Service {
            namespace: &service.namespace,
            name: &service.name,
            service_type: match service.service_type {
                ServiceType::ClusterIp => archived::ServiceType::ClusterIp,
                ServiceType::NodePort => archived::ServiceType::NodePort,
                ServiceType::LoadBalancer => archived::ServiceType::LoadBalancer,
                ServiceType::ExternalName => archived::ServiceType::ExternalName,
            },
            cluster_ips: ips(&service.cluster_ips),
            external_ips: ips(&service.external_ips),
            load_balancer_ips: ips(&service.load_balancer_ips),
            ports: service
                .ports
                .iter()
                .map(|p| archived::ServicePort {
                    name: &p.name,
                    protocol: protocol(p.protocol),
                    port: p.port,
                    node_port: p.node_port,
                    target_port: match &p.target_port {
                        TargetPort::Number(n) => archived::TargetPort::Number(*n),
                        TargetPort::Name(n) => archived::TargetPort::Name(n),
                    },
                })
                .collect(),
            session_affinity_timeout: service.session_affinity_timeout,
            external_traffic_local: service.external_traffic_policy == TrafficPolicy::Local,
            internal_traffic_local: service.internal_traffic_policy == TrafficPolicy::Local,
            labels: service.labels.iter().map(|l| archived::Label { key: &l.key, value: &l.value }).collect(),
        },
        slices: slices
            .iter()
            .map(|s| archived::Slice {
                name: &s.name,
                endpoints: s
                    .endpoints
                    .iter()
                    .map(|e| archived::Endpoint {
                        addresses: ips(&e.addresses),
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                        node_name: e.node_name.as_deref(),
                        zone: e.zone.as_deref(),
                        is_local: e.is_local,
                    })
                    .collect(),
                ports: s
                    .ports
                    .iter()
                    .map(|p| archived::EndpointPort { name: &p.name, protocol: protocol(p.protocol), port: p.port })
                    .collect(),
            })
            .collect(),
    };
    archived::encode_inputs(&inputs, Vec::new())
}

/// The zero-copy prototype gives the typed translation's ruleset on every path, load
/// balancing as data and chains alike, through its own archive and back (as the host reads a
/// guest's).
#[test]
fn the_zero_copy_prototype_translates_every_path_the_same() {
    let dual = |mut s: Service| {
        s.cluster_ips.push("fd00::20".into());
        s
    };
    let node_port = |mut s: Service| {
        s.service_type = ServiceType::NodePort;
        s.ports[0].node_port = 30080;
        s
    };
    let mixed = slice(vec![
        endpoint("10.244.0.11", true, false, true),
        endpoint("10.244.1.11", true, false, false),
        endpoint("10.244.1.12", false, false, false),
        endpoint("fd00:244::11", true, false, false),
    ]);
    let terminating =
        slice(vec![endpoint("10.244.0.11", false, true, true), endpoint("10.244.1.2", false, false, false)]);
    let external_local = |mut s: Service| {
        s = node_port(s);
        s.service_type = ServiceType::LoadBalancer;
        s.load_balancer_ips = vec!["198.51.100.7".into()];
        s.external_traffic_policy = TrafficPolicy::Local;
        s
    };
    // 40 backends, 5 of them here: addresses of one to three digits, whose order as text and
    // as numbers differ.
    let many =
        slice((1..=40).map(|i| endpoint(&format!("10.244.{}.{}", i % 2, i * 6), true, false, i % 8 == 0)).collect());
    let cases: Vec<(&str, Service, Vec<EndpointSlice>)> = vec![
        ("cluster IP", service(), vec![mixed.clone()]),
        ("no endpoints", service(), vec![]),
        ("terminating only", service(), vec![terminating]),
        ("dual stack", dual(service()), vec![mixed.clone()]),
        (
            "node port, dual stack, affinity",
            {
                let mut s = node_port(dual(service()));
                s.session_affinity_timeout = Some(600);
                s
            },
            vec![mixed.clone()],
        ),
        (
            "external and load-balancer IPs",
            {
                let mut s = service();
                s.service_type = ServiceType::LoadBalancer;
                s.external_ips = vec!["203.0.113.5".into()];
                s.load_balancer_ips = vec!["198.51.100.7".into()];
                s.ports[0].node_port = 30080;
                s
            },
            vec![mixed.clone()],
        ),
        (
            "internal traffic local",
            {
                let mut s = service();
                s.internal_traffic_policy = TrafficPolicy::Local;
                s
            },
            vec![slice(vec![endpoint("10.244.1.11", true, false, false)])],
        ),
        (
            "affinity beyond a day",
            {
                let mut s = service();
                s.session_affinity_timeout = Some(100_000);
                s
            },
            vec![mixed.clone()],
        ),
        (
            "headless",
            {
                let mut s = service();
                s.cluster_ips = vec!["None".into()];
                s
            },
            vec![mixed.clone()],
        ),
        // Chains of the port's own.
        ("externalTrafficPolicy Local, a node port and LB IP", external_local(service()), vec![mixed.clone()]),
        (
            "externalTrafficPolicy Local, affinity, a second port",
            {
                let mut s = external_local(service());
                s.session_affinity_timeout = Some(600);
                s.ports.push(ServicePort { name: "".into(), port: 443, node_port: 30443, ..s.ports[0].clone() });
                s
            },
            vec![
                mixed.clone(),
                EndpointSlice {
                    ports: vec![EndpointPort { name: "".into(), protocol: Protocol::Tcp, port: 8443 }],
                    ..mixed.clone()
                },
            ],
        ),
        (
            "externalTrafficPolicy Local, no endpoint here",
            external_local(service()),
            vec![slice(vec![endpoint("10.244.1.11", true, false, false)])],
        ),
        (
            "externalTrafficPolicy Local, IPv6 first",
            {
                let mut s = external_local(service());
                s.cluster_ips = vec!["fd00::20".into(), "10.96.0.20".into()];
                s.session_affinity_timeout = Some(60);
                s
            },
            vec![slice(vec![
                endpoint("fd00:244::11", true, false, true),
                endpoint("fd00:244::12", true, false, false),
            ])],
        ),
        ("more than 32 backends", service(), vec![many.clone()]),
        (
            "more than 32 backends, affinity, internal traffic local",
            {
                let mut s = node_port(service());
                s.session_affinity_timeout = Some(100_000);
                s.internal_traffic_policy = TrafficPolicy::Local;
                s
            },
            vec![many.clone()],
        ),
    ];
    for (case, service, slices) in &cases {
        let archive = archive_of(&ctx(), "svc/shop/web", service, slices);
        // SAFETY: `archive_of` made it.
        // SAFETY: as above.
        let inputs = unsafe { archived::inputs_in_place(&archive) };
        let on_archive = archived::translate(inputs).unwrap();
        let expected = translate(&ctx(), "svc/shop/web", service, slices).unwrap();
        assert_eq!(archived::typed(&on_archive, inputs), archived::canonical(expected), "{case}");
        // SAFETY: as above.
        let output = unsafe { archived::translate_archive(&archive) };
        let read_back: Result<archived::Ruleset, String> =
            rkyv::deserialize::<_, rkyv::rancor::Error>(archived::validate_result(&output).unwrap()).unwrap();
        assert_eq!(read_back, Ok(on_archive), "{case}: the result archive");
    }

    // Each chain case took the chain path (and the others did not).
    let chains = |case: &str| {
        let (_, service, slices) = cases.iter().find(|(c, ..)| *c == case).unwrap();
        translate(&ctx(), "svc/shop/web", service, slices).unwrap().chains.len()
    };
    assert_eq!(chains("cluster IP"), 0);
    assert_eq!(chains("externalTrafficPolicy Local, a node port and LB IP"), 3);
    assert_eq!(chains("more than 32 backends"), 1);
}

/// The host checks a guest's result archive before reading it: a truncated one, or one with
/// a tag no variant has, is an error.
#[test]
fn the_zero_copy_prototype_validates_what_a_guest_returns() {
    let archive =
        archive_of(&ctx(), "svc/shop/web", &service(), &[slice(vec![endpoint("10.244.0.11", true, false, true)])]);
    // SAFETY: `archive_of` made it.
    let output = unsafe { archived::translate_archive(&archive) };
    assert!(archived::validate_result(&output).is_ok());
    assert!(archived::validate_result(&output[..output.len() - 1]).is_err(), "truncated");
    // The result's tag is the archive's last bytes (the root is written last): 0 is Ok.
    let mut bad_tag = output.clone();
    let root = bad_tag.len() - std::mem::size_of::<rkyv::Archived<Result<archived::Ruleset, String>>>();
    bad_tag[root] = 7;
    assert!(archived::validate_result(&bad_tag).is_err(), "an unknown tag");
}
