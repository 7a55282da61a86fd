//! The guest's logic, natively: structure of the output, and its meaning through a small
//! evaluator that applies the host's composition (per-pod union of policy chains, default
//! deny) to packets.

use super::*;
use std::net::IpAddr;
use wasmplane_sdk::lookups::StaticLookups;

fn labels(pairs: &[(&str, &str)]) -> Vec<Label> {
    pairs.iter().map(|(k, v)| Label { key: k.to_string(), value: v.to_string() }).collect()
}

fn sel(pairs: &[(&str, &str)]) -> LabelSelector {
    LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
}

fn pod(ns: &str, name: &str, ip: &str, app: &str) -> Pod {
    Pod {
        namespace: ns.into(),
        name: name.into(),
        ips: vec![ip.into()],
        node_name: Some("node-a".into()),
        labels: labels(&[("app", app)]),
        ports: vec![],
        host_network: false,
    }
}

fn with_port(mut p: Pod, name: &str, protocol: Protocol, port: u16) -> Pod {
    p.ports.push(ContainerPort { name: name.into(), protocol, port });
    p
}

fn ctx() -> NodeContext {
    NodeContext {
        node_name: "node-a".into(),
        node_ips: vec![],
        cluster_cidrs: vec!["10.244.0.0/16".into()],
        pod_cidrs: vec![],
    }
}

/// Namespaces `a`, `b` (team=blue), `c` (team=red); pods web/db/client in each.
fn cluster() -> StaticLookups {
    let mut pods = Vec::new();
    for (n, ns) in ["a", "b", "c"].iter().enumerate() {
        for (m, app) in ["web", "db", "client"].iter().enumerate() {
            let p = pod(ns, &format!("{app}-0"), &format!("10.244.{}.{}", n + 1, m + 10), app);
            pods.push(with_port(with_port(p, "http", Protocol::Tcp, 8080 + n as u16), "dns", Protocol::Udp, 53));
        }
    }
    let namespaces = vec![
        Namespace { name: "a".into(), labels: labels(&[("team", "blue"), ("name", "a")]) },
        Namespace { name: "b".into(), labels: labels(&[("team", "blue"), ("name", "b")]) },
        Namespace { name: "c".into(), labels: labels(&[("team", "red"), ("name", "c")]) },
    ];
    StaticLookups { pods, namespaces }
}

fn ip(l: &StaticLookups, ns: &str, app: &str) -> String {
    l.pods.iter().find(|p| p.namespace == ns && p.labels[0].value == app).unwrap().ips[0].clone()
}

fn policy(
    ns: &str,
    selector: LabelSelector,
    ingress: Option<Vec<PolicyRule>>,
    egress: Option<Vec<PolicyRule>>,
) -> NetworkPolicy {
    NetworkPolicy { namespace: ns.into(), name: "p".into(), generation: 1, pod_selector: selector, ingress, egress }
}

fn peer(pods: Option<LabelSelector>, namespaces: Option<LabelSelector>) -> PolicyPeer {
    PolicyPeer { pod_selector: pods, namespace_selector: namespaces, ip_block: None }
}

fn block(cidr: &str, except: &[&str]) -> PolicyPeer {
    PolicyPeer {
        pod_selector: None,
        namespace_selector: None,
        ip_block: Some(IpBlock { cidr: cidr.into(), except: except.iter().map(|s| s.to_string()).collect() }),
    }
}

fn tcp(port: u16) -> PolicyPort {
    PolicyPort { protocol: Protocol::Tcp, port: PolicyPortNumber::Number(port), end_port: None }
}

fn rule(ports: Vec<PolicyPort>, peers: Vec<PolicyPeer>) -> PolicyRule {
    PolicyRule { ports, peers }
}

/// Compiles `p` with the pods of `l` it selects as the local pods (every pod is on this node).
fn compile_in(l: &StaticLookups, p: &NetworkPolicy) -> Ruleset {
    let local: Vec<Pod> = l
        .pods
        .iter()
        .filter(|x| x.namespace == p.namespace && selector::matches(&p.pod_selector, &x.labels))
        .cloned()
        .collect();
    let prefix = format!("pol/{}/{}", p.namespace, p.name);
    compile(&ctx(), &prefix, p, &local, l).unwrap()
}

// ---- an evaluator of the host's composition -------------------------------------------

struct Packet<'a> {
    src: &'a str,
    dst: &'a str,
    protocol: Protocol,
    port: u16,
}

fn in_cidr(addr: &str, cidr: &str) -> bool {
    cidr.parse::<Cidr>().unwrap().contains(addr.parse::<IpAddr>().unwrap())
}

fn rule_matches(r: &Ruleset, rule: &Rule, p: &Packet) -> bool {
    let set_has = |name: &str, addr: &str| {
        let set = r.sets.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("rule uses undeclared set {name}"));
        set.elements.iter().any(|e| e == addr)
    };
    rule.matches.iter().all(|m| match m {
        RuleMatch::Source(a) => in_cidr(p.src, &a.cidr) != a.negate,
        RuleMatch::Destination(a) => in_cidr(p.dst, &a.cidr) != a.negate,
        RuleMatch::Protocol(x) => *x == p.protocol,
        RuleMatch::DestinationPort(x) => *x == p.port,
        RuleMatch::DestinationPortRange((a, b)) => (*a..=*b).contains(&p.port),
        RuleMatch::SourceInSet(s) => set_has(s, p.src),
        RuleMatch::DestinationInSet(s) => set_has(s, p.dst),
        other => panic!("unexpected match in a policy chain: {other:?}"),
    })
}

/// The verdict of one direction: `None` when no policy selects the pod (allowed).
fn direction_allows(outputs: &[Ruleset], map: &str, addr: &str, p: &Packet) -> Option<bool> {
    let mut selected = false;
    for r in outputs {
        for e in r.map_elements.iter().filter(|e| e.map_name == map && e.key == vec![KeyPart::Address(addr.into())]) {
            selected = true;
            let Verdict::Jump(chain) = &e.verdict else { panic!("map element is not a jump: {e:?}") };
            let chain = r.chains.iter().find(|c| &c.name == chain).expect("jump to a declared chain");
            for rule in &chain.rules {
                assert_eq!(rule.verdict, Verdict::Accept, "policy chains only accept");
                if rule_matches(r, rule, p) {
                    return Some(true);
                }
            }
        }
    }
    selected.then_some(false)
}

fn allowed(outputs: &[Ruleset], p: Packet) -> bool {
    direction_allows(outputs, EGRESS_MAP, p.src, &p).unwrap_or(true)
        && direction_allows(outputs, INGRESS_MAP, p.dst, &p).unwrap_or(true)
}

fn can(outputs: &[Ruleset], src: &str, dst: &str, protocol: Protocol, port: u16) -> bool {
    allowed(outputs, Packet { src, dst, protocol, port })
}

// ---- tests ---------------------------------------------------------------------------------

#[test]
fn ingress_from_pod_selector_in_own_namespace_with_peer_set() {
    let l = cluster();
    let p = policy(
        "a",
        sel(&[("app", "web")]),
        Some(vec![rule(vec![tcp(8080)], vec![peer(Some(sel(&[("app", "client")])), None)])]),
        None,
    );
    let r = compile_in(&l, &p);
    assert_eq!(r.chains.len(), 1);
    assert_eq!(r.chains[0].name, "pol/a/p/ingress");
    let set = r.sets.iter().find(|s| s.name.starts_with("pol/_shared/peers/") && s.name.ends_with("/v4")).unwrap();
    assert_eq!(set.elements, vec![ip(&l, "a", "client")]);
    assert_eq!(r.map_elements.len(), 1);
    assert_eq!(r.map_elements[0].map_name, "pod-ingress");
    assert_eq!(r.map_elements[0].key, vec![KeyPart::Address(ip(&l, "a", "web"))]);
    let web = ip(&l, "a", "web");
    assert!(can(std::slice::from_ref(&r), &ip(&l, "a", "client"), &web, Protocol::Tcp, 8080));
    assert!(!can(std::slice::from_ref(&r), &ip(&l, "a", "client"), &web, Protocol::Tcp, 8081), "other port");
    assert!(!can(std::slice::from_ref(&r), &ip(&l, "a", "client"), &web, Protocol::Udp, 8080), "other protocol");
    assert!(!can(std::slice::from_ref(&r), &ip(&l, "a", "db"), &web, Protocol::Tcp, 8080), "other pod");
    assert!(
        !can(std::slice::from_ref(&r), &ip(&l, "b", "client"), &web, Protocol::Tcp, 8080),
        "same labels, other namespace"
    );
    assert!(can(std::slice::from_ref(&r), &web, &ip(&l, "a", "db"), Protocol::Tcp, 1), "egress not restricted");
    assert!(can(&[r], &ip(&l, "a", "client"), &ip(&l, "a", "db"), Protocol::Tcp, 1), "unselected pod open");
}

#[test]
fn empty_rule_lists_deny_and_policy_types_are_independent() {
    let l = cluster();
    let web = ip(&l, "a", "web");
    let db = ip(&l, "a", "db");
    // policyTypes [Ingress] with no rules: deny all ingress, egress untouched.
    let deny_in = compile_in(&l, &policy("a", sel(&[("app", "web")]), Some(vec![]), None));
    assert!(deny_in.chains[0].rules.is_empty());
    assert!(!can(std::slice::from_ref(&deny_in), &db, &web, Protocol::Tcp, 80));
    assert!(can(&[deny_in], &web, &db, Protocol::Tcp, 80));
    // policyTypes [Egress] with no rules: deny all egress, ingress untouched.
    let deny_out = compile_in(&l, &policy("a", sel(&[("app", "web")]), None, Some(vec![])));
    assert_eq!(deny_out.map_elements[0].map_name, "pod-egress");
    assert!(!can(std::slice::from_ref(&deny_out), &web, &db, Protocol::Udp, 53));
    assert!(can(&[deny_out], &db, &web, Protocol::Tcp, 80));
    // Both types, allow-all rules (`- {}`): everything passes.
    let all =
        compile_in(&l, &policy("a", PodSel::all(), Some(vec![rule(vec![], vec![])]), Some(vec![rule(vec![], vec![])])));
    assert_eq!(all.map_elements.len(), 6, "3 pods x 2 directions");
    assert!(
        can(std::slice::from_ref(&all), &web, &db, Protocol::Sctp, 9)
            && can(&[all], &ip(&l, "c", "web"), &web, Protocol::Udp, 1)
    );
}

struct PodSel;
impl PodSel {
    fn all() -> LabelSelector {
        sel(&[])
    }
}

#[test]
fn namespace_selector_alone_and_combined_with_pod_selector() {
    let l = cluster();
    let web = ip(&l, "a", "web");
    let ns_only = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(vec![], vec![peer(None, Some(sel(&[("team", "blue")])))])]),
            None,
        ),
    );
    for (ns, app, ok) in [("a", "db", true), ("b", "client", true), ("b", "web", true), ("c", "client", false)] {
        assert_eq!(can(std::slice::from_ref(&ns_only), &ip(&l, ns, app), &web, Protocol::Tcp, 80), ok, "{ns}/{app}");
    }
    let both = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(vec![], vec![peer(Some(sel(&[("app", "client")])), Some(sel(&[("team", "blue")])))])]),
            None,
        ),
    );
    for (ns, app, ok) in
        [("a", "client", true), ("b", "client", true), ("b", "db", false), ("c", "client", false), ("a", "db", false)]
    {
        assert_eq!(can(std::slice::from_ref(&both), &ip(&l, ns, app), &web, Protocol::Tcp, 80), ok, "{ns}/{app}");
    }
    // Two separate peers are a union: clients of a, or anything in c.
    let union = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(
                vec![],
                vec![peer(Some(sel(&[("app", "client")])), None), peer(None, Some(sel(&[("team", "red")])))],
            )]),
            None,
        ),
    );
    for (ns, app, ok) in [("a", "client", true), ("c", "db", true), ("b", "client", false), ("a", "db", false)] {
        assert_eq!(can(std::slice::from_ref(&union), &ip(&l, ns, app), &web, Protocol::Tcp, 80), ok, "{ns}/{app}");
    }
    // An empty namespace selector: every namespace.
    let every = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(vec![], vec![peer(Some(sel(&[("app", "db")])), Some(sel(&[])))])]),
            None,
        ),
    );
    assert_eq!(every.sets.iter().find(|s| peer_sets(&every).contains(&s.name.as_str())).unwrap().elements.len(), 3);
}

#[test]
fn ip_block_with_except_both_directions() {
    let l = cluster();
    let web = ip(&l, "a", "web");
    let p = policy(
        "a",
        sel(&[("app", "web")]),
        Some(vec![rule(vec![], vec![block("10.244.0.0/16", &["10.244.2.0/24", "10.244.3.10/32"])])]),
        Some(vec![rule(vec![tcp(443)], vec![block("192.168.0.0/16", &["192.168.1.0/24"])])]),
    );
    let r = compile_in(&l, &p);
    let ingress = r.chains.iter().find(|c| c.name == "pol/a/p/ingress").unwrap();
    assert_eq!(ingress.rules.len(), 1, "no selector peer: no set, one ipBlock rule");
    assert!(r.sets.is_empty());
    assert_eq!(ingress.rules[0].matches.len(), 3);
    // Sources are no selected pod (web's own egress policy would decide for those).
    for (src, ok) in [
        ("10.244.1.99", true),
        ("10.244.2.11", false),
        ("10.244.3.10", false),
        ("10.244.3.11", true),
        ("10.1.0.1", false),
    ] {
        assert_eq!(can(std::slice::from_ref(&r), src, &web, Protocol::Tcp, 80), ok, "from {src}");
    }
    for (dst, port, ok) in
        [("192.168.7.1", 443, true), ("192.168.1.1", 443, false), ("192.168.7.1", 80, false), ("8.8.8.8", 443, false)]
    {
        assert_eq!(can(std::slice::from_ref(&r), &web, dst, Protocol::Tcp, port), ok, "to {dst}:{port}");
    }
    let bad = policy("a", sel(&[]), Some(vec![rule(vec![], vec![block("10.0.0.0/8", &["fd00::/64"])])]), None);
    assert!(compile(&ctx(), "pol/a/p", &bad, &[], &l).unwrap_err().message.contains("family"));
    let bad = policy("a", sel(&[]), Some(vec![rule(vec![], vec![block("ten/8", &[])])]), None);
    assert!(compile(&ctx(), "pol/a/p", &bad, &[], &l).is_err());
}

#[test]
fn ports_protocols_and_end_port_ranges() {
    let l = cluster();
    let web = ip(&l, "a", "web");
    let db = ip(&l, "a", "db");
    let ports = vec![
        PolicyPort { protocol: Protocol::Udp, port: PolicyPortNumber::Any, end_port: None },
        PolicyPort { protocol: Protocol::Tcp, port: PolicyPortNumber::Number(8000), end_port: Some(8010) },
        PolicyPort { protocol: Protocol::Sctp, port: PolicyPortNumber::Number(9000), end_port: None },
    ];
    let r = compile_in(&l, &policy("a", sel(&[("app", "web")]), Some(vec![rule(ports, vec![])]), None));
    for (proto, port, ok) in [
        (Protocol::Udp, 1, true),
        (Protocol::Udp, 65535, true),
        (Protocol::Tcp, 7999, false),
        (Protocol::Tcp, 8000, true),
        (Protocol::Tcp, 8010, true),
        (Protocol::Tcp, 8011, false),
        (Protocol::Sctp, 9000, true),
        (Protocol::Sctp, 9001, false),
    ] {
        assert_eq!(can(std::slice::from_ref(&r), &db, &web, proto, port), ok, "{proto:?}/{port}");
    }
    let bad = |port, end| {
        policy(
            "a",
            sel(&[]),
            Some(vec![rule(vec![PolicyPort { protocol: Protocol::Tcp, port, end_port: end }], vec![])]),
            None,
        )
    };
    assert!(
        compile(&ctx(), "pol/a/p", &bad(PolicyPortNumber::Number(90), Some(80)), &[], &l)
            .unwrap_err()
            .message
            .contains("endPort")
    );
    assert!(compile(&ctx(), "pol/a/p", &bad(PolicyPortNumber::Name("http".into()), Some(80)), &[], &l).is_err());
}

#[test]
fn named_ports_resolve_on_the_destination() {
    let mut l = cluster();
    // Ingress to every pod of namespace a on "http": web/db/client all say 8080 there.
    let named = |dir_in: bool| {
        let r = vec![rule(
            vec![PolicyPort { protocol: Protocol::Tcp, port: PolicyPortNumber::Name("http".into()), end_port: None }],
            vec![],
        )];
        if dir_in {
            policy("a", sel(&[]), Some(r), None)
        } else {
            policy("a", sel(&[("app", "client")]), None, Some(r))
        }
    };
    let r = compile_in(&l, &named(true));
    assert!(r.sets.is_empty(), "uniform resolution needs no destination set");
    assert!(can(std::slice::from_ref(&r), "10.9.9.9", &ip(&l, "a", "db"), Protocol::Tcp, 8080));
    assert!(!can(std::slice::from_ref(&r), "10.9.9.9", &ip(&l, "a", "db"), Protocol::Tcp, 8081));
    assert!(!can(&[r], "10.9.9.9", &ip(&l, "a", "db"), Protocol::Udp, 8080), "named port has a protocol");

    // web in a now serves http on 9090: per-destination resolution.
    l.pods[0].ports[0].port = 9090;
    let r = compile_in(&l, &named(true));
    let (web, db) = (ip(&l, "a", "web"), ip(&l, "a", "db"));
    assert!(can(std::slice::from_ref(&r), "10.9.9.9", &web, Protocol::Tcp, 9090));
    assert!(!can(std::slice::from_ref(&r), "10.9.9.9", &web, Protocol::Tcp, 8080));
    assert!(can(std::slice::from_ref(&r), "10.9.9.9", &db, Protocol::Tcp, 8080));
    assert!(!can(&[r], "10.9.9.9", &db, Protocol::Tcp, 9090));

    // Egress from clients of a to "http" anywhere: each destination's own number.
    let r = compile_in(&l, &named(false));
    let client = ip(&l, "a", "client");
    assert!(can(std::slice::from_ref(&r), &client, &web, Protocol::Tcp, 9090));
    assert!(!can(std::slice::from_ref(&r), &client, &web, Protocol::Tcp, 8080));
    assert!(can(std::slice::from_ref(&r), &client, &ip(&l, "b", "web"), Protocol::Tcp, 8081));
    assert!(can(std::slice::from_ref(&r), &client, &ip(&l, "c", "db"), Protocol::Tcp, 8082));
    assert!(!can(std::slice::from_ref(&r), &client, &ip(&l, "c", "db"), Protocol::Tcp, 8081));
    assert!(!can(&[r], &client, "1.1.1.1", Protocol::Tcp, 8080), "no pod: the name does not resolve");

    // Egress named port limited to the rule's peers.
    let p = policy(
        "a",
        sel(&[("app", "client")]),
        None,
        Some(vec![rule(
            vec![PolicyPort { protocol: Protocol::Udp, port: PolicyPortNumber::Name("dns".into()), end_port: None }],
            vec![peer(Some(sel(&[("app", "db")])), Some(sel(&[])))],
        )]),
    );
    let r = compile_in(&l, &p);
    assert!(can(std::slice::from_ref(&r), &client, &ip(&l, "c", "db"), Protocol::Udp, 53));
    assert!(!can(&[r], &client, &ip(&l, "c", "web"), Protocol::Udp, 53));
}

#[test]
fn policies_combine_as_a_union() {
    let l = cluster();
    let web = ip(&l, "a", "web");
    let from_clients = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(vec![tcp(80)], vec![peer(Some(sel(&[("app", "client")])), None)])]),
            None,
        ),
    );
    let mut from_c =
        policy("a", sel(&[]), Some(vec![rule(vec![], vec![peer(None, Some(sel(&[("team", "red")])))])]), None);
    from_c.name = "q".into();
    let from_c = compile_in(&l, &from_c);
    let both = [from_clients.clone(), from_c.clone()];
    assert!(can(&both, &ip(&l, "a", "client"), &web, Protocol::Tcp, 80));
    assert!(!can(&[from_c], &ip(&l, "a", "client"), &web, Protocol::Tcp, 80));
    assert!(can(&both, &ip(&l, "c", "db"), &web, Protocol::Udp, 5));
    assert!(!can(&[from_clients], &ip(&l, "c", "db"), &web, Protocol::Udp, 5));
    assert!(!can(&both, &ip(&l, "b", "client"), &web, Protocol::Tcp, 80), "allowed by neither");
}

#[test]
fn a_peer_label_change_changes_set_elements_only() {
    let mut l = cluster();
    let p = policy(
        "a",
        sel(&[("app", "web")]),
        Some(vec![rule(vec![tcp(80)], vec![peer(Some(sel(&[("app", "client")])), Some(sel(&[("team", "blue")])))])]),
        None,
    );
    let before = compile_in(&l, &p);
    // db in b becomes a client.
    let db_b = l.pods.iter_mut().find(|x| x.namespace == "b" && x.labels[0].value == "db").unwrap();
    db_b.labels[0].value = "client".into();
    let after = compile_in(&l, &p);
    assert_eq!(before.chains, after.chains);
    assert_eq!(before.map_elements, after.map_elements);
    assert_ne!(before.sets, after.sets);
    assert_eq!(after.sets[0].elements.len(), before.sets[0].elements.len() + 1);
    // Namespace relabel: c joins blue.
    l.namespaces[2].labels[0].value = "blue".into();
    let later = compile_in(&l, &p);
    assert_eq!(before.chains, later.chains);
    assert!(can(&[later], &ip(&l, "c", "client"), &ip(&l, "a", "web"), Protocol::Tcp, 80));
}

#[test]
fn host_network_and_unselected_local_pods_are_ignored() {
    let mut l = cluster();
    l.pods[2].host_network = true; // a/client
    let p = policy("a", sel(&[]), Some(vec![rule(vec![], vec![peer(Some(sel(&[])), None)])]), None);
    let local = l.pods.clone();
    let r = compile(&ctx(), "pol/a/p", &p, &local, &l).unwrap();
    assert_eq!(r.map_elements.len(), 2, "web and db of a: not the host-network pod, not other namespaces");
    assert_eq!(r.sets[0].elements.len(), 2, "host-network pods are no peers");
    let nothing = compile(&ctx(), "pol/a/p", &p, &[], &l).unwrap();
    assert!(nothing.map_elements.is_empty() && !nothing.warnings.is_empty());
}

#[test]
fn dual_stack_declares_a_set_per_family() {
    let mut l = cluster();
    l.pods[2].ips.push("fd00::a:c".into());
    let mut node = ctx();
    node.cluster_cidrs.push("fd00::/48".into());
    let p = policy(
        "a",
        sel(&[("app", "web")]),
        Some(vec![rule(vec![], vec![peer(Some(sel(&[("app", "client")])), None)])]),
        None,
    );
    let r = compile(&node, "pol/a/p", &p, &[l.pods[0].clone()], &l).unwrap();
    let names: Vec<&str> = r.sets.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 2);
    assert!(names[0].starts_with("pol/_shared/peers/") && names[0].ends_with("/v4"), "{names:?}");
    assert_eq!(names[1], names[0].replace("/v4", "/v6"));
    assert_eq!(r.sets[1].elements, vec!["fd00::a:c".to_string()]);
    assert_eq!(r.sets[1].family, AddressFamily::Ipv6);
}

/// The peer set of each rule, by name (v4 only).
fn peer_sets(r: &Ruleset) -> Vec<&str> {
    r.sets
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| n.starts_with("pol/_shared/peers/") && n.ends_with("/v4"))
        .collect()
}

#[test]
fn policies_with_the_same_peers_share_one_set() {
    let l = cluster();
    let clients = || peer(Some(sel(&[("app", "client")])), None);
    let db_anywhere = || peer(Some(sel(&[("app", "db")])), Some(sel(&[])));
    let one = compile_in(
        &l,
        &policy("a", sel(&[("app", "web")]), Some(vec![rule(vec![tcp(80)], vec![clients(), db_anywhere()])]), None),
    );
    // Another policy, other ports, the same peers in another order: the same set.
    let two = compile_in(
        &l,
        &policy("a", sel(&[("app", "db")]), Some(vec![rule(vec![tcp(5432)], vec![db_anywhere(), clients()])]), None),
    );
    assert_eq!(peer_sets(&one).len(), 1);
    assert_eq!(peer_sets(&one), peer_sets(&two));
    assert_eq!(one.sets[0].elements, two.sets[0].elements);
    // A pod selector alone means the policy's own namespace: another namespace, another set.
    let elsewhere = compile_in(&l, &policy("b", sel(&[]), Some(vec![rule(vec![], vec![clients()])]), None));
    let here = compile_in(&l, &policy("a", sel(&[]), Some(vec![rule(vec![], vec![clients()])]), None));
    assert_ne!(peer_sets(&elsewhere), peer_sets(&here));
    assert_ne!(peer_sets(&here), peer_sets(&one), "fewer peers, another set");
    // One policy naming the same peers in two rules and both directions declares it once.
    let both = compile_in(
        &l,
        &policy(
            "a",
            sel(&[("app", "web")]),
            Some(vec![rule(vec![tcp(80)], vec![clients()]), rule(vec![tcp(81)], vec![clients()])]),
            Some(vec![rule(vec![], vec![clients()])]),
        ),
    );
    assert_eq!(peer_sets(&both), peer_sets(&here));
    let web = ip(&l, "a", "web");
    assert!(can(std::slice::from_ref(&both), &ip(&l, "a", "client"), &web, Protocol::Tcp, 81));
}
