//! The netlink writer of incremental transactions against `nft -f`: the same transactions
//! applied in two network namespaces, one through each, must leave tables that `nft list`
//! prints identically, step after step; a failing transaction must fail whole, naming the
//! statement, and leave the table as it was.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use support::netns::{Netns, require_root, unique_prefix};
use support::set_holds;
use wasmplane::dataplane::{Dataplane, Kernel, NetlinkNft, NftCommand};
use wasmplane::nft::{self, ElementKey, ObjectRules, SetRules};
use wasmplane_model::{CompactString, FirewalledFrontend, Protocol, format_compact};

fn ns_command(ns: &Netns) -> Vec<String> {
    ["ip", "netns", "exec", &ns.name, "nft"].map(String::from).to_vec()
}

fn object(
    chains: &[(&str, &[&str])],
    sets: &[(&str, &str, &[&str], bool)],
    elements: &[(&str, &str, &str)],
) -> ObjectRules {
    ObjectRules {
        chains: chains
            .iter()
            .map(|(n, rules)| (n.to_string(), rules.iter().map(|r| r.to_string()).collect()))
            .collect(),
        sets: sets
            .iter()
            .map(|(n, decl, elements, expires)| {
                (
                    n.to_string(),
                    SetRules {
                        declaration: decl.to_string(),
                        elements: elements.iter().map(|e| e.to_string()).collect(),
                        expires: *expires,
                    },
                )
            })
            .collect(),
        elements: elements.iter().map(|&(m, k, v)| ((m.into(), k.into()), v.into())).collect(),
        warnings: Vec::new(),
        service_prefix: None,
        created_unix: None,
    }
}

/// Two namespaces named after `text_tag` and `batch_tag`, and the two writers of the same
/// transactions: `nft -f` into the first, the netlink batch into the second.
fn twins(text_tag: &str, batch_tag: &str) -> (Netns, Netns, NftCommand, NetlinkNft) {
    let text_ns = Netns::new(unique_prefix(text_tag));
    let netlink_ns = Netns::new(unique_prefix(batch_tag));
    let text = NftCommand::new(ns_command(&text_ns), vec![]);
    let netlink = NetlinkNft::open(
        NftCommand::new(ns_command(&netlink_ns), vec![]),
        NetlinkNft::netns_of_command(&ns_command(&netlink_ns)).as_deref(),
    )
    .expect("opening the netlink socket in the namespace");
    (text_ns, netlink_ns, text, netlink)
}

/// Several shard tables, so that one transaction spans tables (services hash to shards).
const LAYOUT: nft::Layout = nft::Layout { shards: 4 };

const AFFINITY: &str = "type ipv4_addr; flags dynamic,timeout; timeout 10800s;";

/// A ClusterIP + NodePort service with affinity and `endpoints` (one chain each).
fn service_a(endpoints: &[&str]) -> ObjectRules {
    let n = endpoints.len();
    let dispatch: Vec<String> = std::iter::once(
        "ip saddr != 10.244.0.0/16 ip daddr 10.96.0.1 meta l4proto tcp th dport 80 jump mark-for-masquerade"
            .to_string(),
    )
    .chain(endpoints.iter().map(|ip| format!("ip saddr @svc/ns/a/ep/{ip}/affinity goto svc/ns/a/ep/{ip}")))
    .chain(endpoints.iter().enumerate().map(|(i, ip)| format!("numgen random mod {n} == {i} goto svc/ns/a/ep/{ip}")))
    .collect();
    let mut rules = ObjectRules::default();
    rules.chains.insert("svc/ns/a".into(), dispatch);
    for ip in endpoints {
        rules.chains.insert(
            format!("svc/ns/a/ep/{ip}"),
            vec![
                format!("ip saddr {ip} jump mark-for-masquerade"),
                format!("update @svc/ns/a/ep/{ip}/affinity {{ ip saddr timeout 10800s }}"),
                format!("meta l4proto tcp dnat ip to {ip}:8080"),
            ],
        );
        rules.sets.insert(
            format!("svc/ns/a/ep/{ip}/affinity"),
            SetRules { declaration: AFFINITY.into(), elements: BTreeSet::new(), expires: true },
        );
        rules.elements.insert(("hairpin".into(), format_compact!("{ip} . {ip}")), CompactString::default());
    }
    rules.elements.insert(("service-ips".into(), "10.96.0.1 . tcp . 80".into()), "goto svc/ns/a".into());
    rules.elements.insert(("service-nodeports".into(), "tcp . 30080".into()), "goto svc/ns/a".into());
    rules.elements.insert(("cluster-ips".into(), "10.96.0.1".into()), CompactString::default());
    rules
}

/// Session affinity in one chain (the default translator's shape): remembered clients back
/// to their endpoint, then the draw; every DNAT records the client in the endpoint's set.
fn service_e(endpoints: &[&str]) -> ObjectRules {
    let n = endpoints.len();
    let set = |ip: &str| format!("svc/ns/e/ep/{ip}/8080/affinity");
    let remember =
        |ip: &str| format!("meta l4proto tcp update @{} {{ ip saddr timeout 10800s }} dnat ip to {ip}:8080", set(ip));
    let chain: Vec<String> = endpoints
        .iter()
        .map(|ip| format!("ip saddr @{} {}", set(ip), remember(ip)))
        .chain(endpoints.iter().enumerate().map(|(i, ip)| {
            if n - i > 1 { format!("numgen random mod {} == 0 {}", n - i, remember(ip)) } else { remember(ip) }
        }))
        .collect();
    let mut rules = ObjectRules::default();
    rules.chains.insert("svc/ns/e/tcp/http".into(), chain);
    for ip in endpoints {
        rules.sets.insert(set(ip), SetRules { declaration: AFFINITY.into(), elements: BTreeSet::new(), expires: true });
    }
    rules.elements.insert(("service-ips".into(), "10.96.0.5 . tcp . 80".into()), "goto svc/ns/e/tcp/http".into());
    rules
}

/// Every other word of the rule vocabulary, IPv6 and the no-endpoint maps.
fn service_b(port: u16) -> ObjectRules {
    object(
        &[
            (
                "svc/ns/b",
                &[
                    "ip6 daddr fd00::/64 th dport 30000-30100 counter return",
                    "fib daddr type local th dport 30081 goto svc/ns/b/ep",
                    "ct state established,related accept",
                    "ip saddr 10.244.16.0/20 log prefix \"wp test: \" drop comment \"hello world\"",
                    "ip6 saddr fd00:10::/28 reject",
                    "ip daddr 10.96.0.2 reject",
                    "meta l4proto sctp reject",
                    "ip saddr 0.0.0.0/0 accept",
                    // The pod-traffic match in each mode (`nft::PodTraffic::render`), both ways.
                    "ip saddr @cluster-cidrs th dport 30081 accept",
                    "ip saddr != @cluster-cidrs ip daddr 10.96.0.2 jump mark-for-masquerade",
                    "ip6 saddr != @cluster-cidrs6 ip6 daddr fd00::2 jump mark-for-masquerade",
                    "iifname \"veth*\" accept",
                    "iifname != \"veth*\" ip daddr 10.96.0.2 jump mark-for-masquerade",
                    "iifname \"cbr0\" ip6 saddr @cluster-cidrs6 accept",
                    "iifname != \"cbr0\" reject",
                ],
            ),
            (
                "svc/ns/b/ep",
                &[
                    &format!("meta l4proto udp dnat ip6 to [fd00::5]:{port}"),
                    "meta l4proto tcp dnat ip to 10.244.2.7:53",
                ],
            ),
        ],
        &[],
        &[
            ("service-ips6", "fd00::2 . udp . 53", "goto svc/ns/b"),
            ("no-endpoint-services", "10.96.0.9 . udp . 53", "goto reject-chain"),
            ("no-endpoint-nodeports", "sctp . 30090", "drop"),
        ],
    )
}

/// A service load balanced as data (the default translator's shape): numbered backends in
/// its shard's endpoint map, the frontend counted in the count set of their number and sent
/// to the by-count chain.
fn service_c(backends: &[&str]) -> ObjectRules {
    let mut rules = object(&[], &[], &[]);
    rules.service_prefix = Some("svc/ns/c".into());
    let front = "10.96.0.3 . udp . 53";
    for (i, b) in backends.iter().enumerate() {
        rules
            .elements
            .insert(("service-endpoints".into(), format_compact!("{front} . {i}")), format_compact!("{b} . 5353"));
    }
    rules.elements.insert(("service-ips".into(), front.into()), "goto pick-by-count".into());
    rules.elements.insert((format_compact!("frontends-{}", backends.len()), front.into()), CompactString::default());
    rules.elements.insert(("masquerade-off-cluster".into(), front.into()), CompactString::default());
    rules.elements.insert(("service-endpoints6".into(), "fd00::3 . tcp . 80 . 0".into()), "fd00::33 . 8080".into());
    rules.elements.insert(("service-ips6".into(), "fd00::3 . tcp . 80".into()), "goto pick-by-count6".into());
    rules.elements.insert(("frontends6-1".into(), "fd00::3 . tcp . 80".into()), CompactString::default());
    // Its node port, as data too: numbered per family, dispatched by the shard.
    let node_port = "udp . 30053";
    for (i, b) in backends.iter().enumerate() {
        rules
            .elements
            .insert(("nodeport-endpoints".into(), format_compact!("{node_port} . {i}")), format_compact!("{b} . 5353"));
    }
    rules.elements.insert(("nodeport-picks".into(), node_port.into()), "goto nodeport-pick-by-count".into());
    rules
        .elements
        .insert((format_compact!("nodeports-{}", backends.len()), node_port.into()), CompactString::default());
    rules.elements.insert(("nodeport-endpoints6".into(), format_compact!("{node_port} . 0")), "fd00::33 . 5353".into());
    rules.elements.insert(("nodeport-picks6".into(), node_port.into()), "goto nodeport-pick-by-count6".into());
    rules.elements.insert(("nodeports6-1".into(), node_port.into()), CompactString::default());
    rules.elements.insert(("service-nodeports".into(), node_port.into()), "goto nodeport-dispatch".into());
    rules
}

/// Session affinity as data: numbered backends, the frontend counted and sent to the
/// by-count chain of its timeout (declared by the writer, see `affinity_chain`).
fn service_f(backends: &[&str]) -> ObjectRules {
    let mut rules = object(&[], &[], &[]);
    rules.service_prefix = Some("svc/ns/f".into());
    let front = "10.96.0.6 . tcp . 80";
    for (i, b) in backends.iter().enumerate() {
        rules
            .elements
            .insert(("service-endpoints".into(), format_compact!("{front} . {i}")), format_compact!("{b} . 8080"));
    }
    rules.elements.insert(("service-ips".into(), front.into()), "goto affinity-10800-pick-by-count".into());
    rules.elements.insert((format_compact!("frontends-{}", backends.len()), front.into()), CompactString::default());
    rules
}

fn policy(peers: &[&str]) -> ObjectRules {
    object(
        // Policies' pod-traffic matches look sources up in the main table's cluster-cidrs sets.
        &[(
            "pol/ns/p/in",
            &[
                "ip saddr @pol/ns/p/peers meta l4proto tcp th dport 80 accept",
                "ip saddr 10.0.0.0/8 accept",
                "ip6 saddr != @cluster-cidrs6 accept",
                "iifname != \"veth*\" accept",
            ],
        )],
        &[("pol/ns/p/peers", "type ipv4_addr;", peers, false)],
        &[],
    )
}

fn dispatch() -> ObjectRules {
    object(
        &[
            (
                "polpod/10.244.0.5/ingress",
                &[
                    "counter jump pol/ns/p/in",
                    "counter log prefix \"wasmplane-policy-audit ingress 10.244.0.5: \" accept comment \"audit\"",
                ],
            ),
            // The verdict log's shape: a rate-limited NFLOG rule before the verdict.
            (
                "polpod/10.244.0.5/egress",
                &[
                    "counter jump pol/ns/p/in",
                    "limit rate 10/second burst 20 packets log group 1001 prefix \"wasmplane-policy deny egress 10.244.0.5\"",
                    "counter drop comment \"deny\"",
                ],
            ),
        ],
        &[],
        &[
            ("pod-ingress", "10.244.0.5", "goto polpod/10.244.0.5/ingress"),
            ("pod-egress", "10.244.0.5", "goto polpod/10.244.0.5/egress"),
        ],
    )
}

/// A load balancer firewall (`spec.loadBalancerSourceRanges`): interval elements with
/// concatenated keys, which the batch sends as first and last key.
fn firewall(ranges: &[&str]) -> ObjectRules {
    let frontend = |address: &str, ranges: Vec<&str>| FirewalledFrontend {
        address: address.parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 443,
        allowed: ranges.iter().map(|r| r.parse().unwrap()).collect(),
    };
    let v6: Vec<&str> = ranges.iter().copied().filter(|r| r.contains(':')).collect();
    let v4: Vec<&str> = ranges.iter().copied().filter(|r| !r.contains(':')).collect();
    nft::firewall_rules(&[frontend("203.0.113.10", v4), frontend("2001:db8::10", v6)]).unwrap()
}

/// Objects by key. The dispatch object "d" sorts before the policy "p" its chain jumps to:
/// the delta must not depend on the order objects come in.
type State = BTreeMap<&'static str, ObjectRules>;

fn delta(old: &State, new: &State) -> String {
    let empty = ObjectRules::default();
    let keys: BTreeSet<&&str> = old.keys().chain(new.keys()).collect();
    let pairs: Vec<(&ObjectRules, &ObjectRules)> =
        keys.into_iter().map(|k| (old.get(*k).unwrap_or(&empty), new.get(*k).unwrap_or(&empty))).collect();
    let mut out = String::new();
    nft::objects_delta(&pairs, &mut out, LAYOUT);
    // Shared-set elements, as the writer counts them: those no object had or has any more.
    let shared = |state: &State| -> BTreeSet<ElementKey> {
        state.values().flat_map(|r| r.elements.keys()).filter(|(set, _)| nft::is_shared_set(set)).cloned().collect()
    };
    let (before, after) = (shared(old), shared(new));
    nft::shared_elements(&mut out, before.difference(&after), false);
    nft::shared_elements(&mut out, after.difference(&before), true);
    out
}

#[test]
fn netlink_batches_leave_the_table_nft_would() {
    require_root!();
    let (text_ns, netlink_ns, mut text, mut netlink) = twins("nl-text", "nl-batch");
    let listing = |ns: &Netns| ns.exec(&["nft", "list", "ruleset"]);

    let mut state: State = BTreeMap::new();
    state.insert("a", service_a(&["10.244.1.5", "10.244.1.6"]));
    state.insert("b", service_b(53));
    state.insert("p", policy(&["10.244.0.7", "10.244.0.8"]));
    state.insert("d", dispatch());
    state.insert("c", service_c(&["10.244.3.1", "10.244.3.2"]));
    state.insert("e", service_e(&["10.244.5.1", "10.244.5.2"]));
    state.insert("f", service_f(&["10.244.6.1", "10.244.6.2"]));
    state.insert("w", firewall(&["198.51.100.0/24", "203.0.113.10/32", "2001:db8:1::/48"]));
    let full = nft::full_transaction(state.values(), &nft::Stale::default(), LAYOUT, &nft::NodeNetworks::default());
    text.apply(&full).unwrap();
    netlink.apply(&full).unwrap();
    assert_eq!(netlink.text_transactions, 1, "a full transaction goes through nft -f");
    assert_eq!(listing(&text_ns), listing(&netlink_ns));
    // Settling after a full transaction commits and changes nothing.
    netlink.settle().expect("settling batch");
    assert_eq!(listing(&text_ns), listing(&netlink_ns));
    assert_eq!(
        (netlink.text_transactions, netlink.netlink_transactions),
        (1, 0),
        "settling is not a transaction of ours"
    );

    let mut steps: Vec<(&str, State)> = Vec::new();
    let mut next = state.clone();
    next.insert("a", service_a(&["10.244.1.6", "10.244.1.9", "10.244.1.10"]));
    steps.push(("endpoints replaced (chains, sets of kept endpoints kept)", next.clone()));
    next.insert("p", policy(&["10.244.0.8", "10.244.0.9", "10.244.0.10"]));
    steps.push(("policy peers changed: set element deltas", next.clone()));
    next.insert("c", service_c(&["10.244.3.1", "10.244.3.5", "10.244.3.9"]));
    steps.push(("backends as data: renumbered, a third, another pick chain", next.clone()));
    next.insert("e", service_e(&["10.244.5.2", "10.244.5.3", "10.244.5.4"]));
    steps.push(("affinity in one chain: endpoints replaced, their sets with them", next.clone()));
    next.insert("f", service_f(&["10.244.6.1", "10.244.6.3"]));
    steps.push(("affinity as data: a backend replaced, elements only", next.clone()));
    next.insert("f", service_f(&["10.244.6.1", "10.244.6.3", "10.244.6.4"]));
    steps.push(("affinity as data: scaled up, the goto element to the chain of 3", next.clone()));
    next.insert("b", service_b(5353));
    steps.push(("one rule of an endpoint chain changed", next.clone()));
    next.insert("w", firewall(&["198.51.100.0/25", "10.0.0.0/8", "2001:db8:1::/48", "2001:db8:2::1/128"]));
    steps.push(("firewall ranges changed: interval elements deleted and added", next.clone()));
    next.remove("w");
    steps.push(("a firewall removed", next.clone()));
    next.insert("w", firewall(&["192.0.2.0/24", "2001:db8::/32"]));
    steps.push(("a firewall back", next.clone()));
    next.remove("b");
    next.remove("d");
    steps.push(("a service and a dispatch object removed", next.clone()));
    next.insert("b", service_b(53));
    next.insert("d", dispatch());
    steps.push(("both back", next.clone()));
    next.insert("a", service_a(&["10.244.1.6"]));
    steps.push(("scaled to one endpoint", next.clone()));
    next.remove("p");
    next.remove("d");
    steps.push(("the policy and its dispatch removed (a set with elements deleted)", next.clone()));
    next.insert("p", policy(&["10.244.0.7", "10.244.0.11"]));
    next.insert("d", dispatch());
    steps.push(("the policy back (a set created with elements)", next.clone()));

    let mut current = state;
    for (what, wanted) in steps {
        let transaction = delta(&current, &wanted);
        assert!(!transaction.is_empty(), "{what}: no change rendered");
        let before = netlink.netlink_transactions;
        text.apply(&transaction).unwrap_or_else(|e| panic!("{what}: nft -f refused {e}:\n{transaction}"));
        netlink
            .apply(&transaction)
            .unwrap_or_else(|e| panic!("{what}: the netlink batch was refused: {e}:\n{transaction}"));
        assert_eq!(netlink.netlink_transactions, before + 1, "{what}: not sent as netlink:\n{transaction}");
        assert_eq!(listing(&text_ns), listing(&netlink_ns), "{what}: the tables differ after\n{transaction}");
        // The writer's listing for reconciliation: one kernel dump, the same names as nft's.
        let (mut dumped, mut listed) = (netlink.list_objects().unwrap(), text.list_objects().unwrap());
        for l in [&mut dumped, &mut listed] {
            l.chains.sort();
            l.sets.sort();
        }
        assert_eq!(dumped, listed, "{what}: netlink and nft list different objects");
        assert!(
            dumped.tables.len() >= 2 && dumped.chains.iter().any(|(_, c)| c == "svc/ns/a") && !dumped.sets.is_empty(),
            "{what}: {dumped:?}"
        );
        current = wanted;
    }
    let table = listing(&netlink_ns);
    assert!(table.contains("numgen random mod 1 0 goto svc/ns/a/ep/10.244.1.6"), "{table}");
    for pod_traffic in [
        "ip saddr != @cluster-cidrs ip daddr 10.96.0.2 jump",
        "iifname != \"veth*\" ip daddr",
        "iifname \"cbr0\" ip6 saddr @cluster-cidrs6 accept",
        "ip6 saddr != @cluster-cidrs6 accept",
    ] {
        assert!(table.contains(pod_traffic), "{pod_traffic:?} missing in {table}");
    }
    assert!(table.contains("10.96.0.1 . tcp . 80 : goto svc/ns/a"), "{table}");
    assert!(table.contains("elements = { 10.244.0.7, 10.244.0.11 }"), "{table}");
    assert!(table.contains("elements = { 10.244.1.6 . 10.244.1.6 }"), "hairpin pairs added and deleted: {table}");
    assert!(
        set_holds(&table, "firewall-allowed", "203.0.113.10 . tcp . 443 . 192.0.2.0/24")
            && set_holds(&table, "firewall-allowed6", "2001:db8::10 . tcp . 443 . 2001:db8::/32"),
        "{table}"
    );
    assert!(
        set_holds(&table, "firewall-ips6", "2001:db8::10 . tcp . 443") && !table.contains("198.51.100.0"),
        "{table}"
    );
    assert!(
        table.contains("10.96.0.3 . udp . 53 . 2 : 10.244.3.9 . 5353")
            && set_holds(&table, "frontends-3", "10.96.0.3 . udp . 53"),
        "{table}"
    );
    assert!(table.contains("ip saddr @svc/ns/e/ep/10.244.5.3/8080/affinity meta l4proto tcp update @svc/ns/e/ep/10.244.5.3/8080/affinity { ip saddr timeout 3h } dnat ip to 10.244.5.3:8080"), "{table}");
    assert!(
        table.contains("udp . 30053 . 2 : 10.244.3.9 . 5353") && set_holds(&table, "nodeports-3", "udp . 30053"),
        "{table}"
    );
    assert!(
        table.contains("10.96.0.6 . tcp . 80 : goto affinity-10800-pick-by-count")
            && set_holds(&table, "frontends-3", "10.96.0.6 . tcp . 80")
            && table.contains("10.96.0.6 . tcp . 80 . 2 : 10.244.6.4 . 8080"),
        "{table}"
    );
    assert!(
        table.contains("update @affinity-slot-2 { ip saddr . ip daddr . meta l4proto . th dport timeout 3h } dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 offset 2 map @service-endpoints"),
        "{table}"
    );

    // An interval set (not encoded: nft computes interval elements): the transaction goes through nft.
    let mut changed = current.clone();
    let mut p = policy(&["10.244.0.8"]);
    p.sets.get_mut("pol/ns/p/peers").unwrap().declaration = "type ipv4_addr; flags interval;".into();
    changed.insert("p", p);
    let transaction = delta(&current, &changed);
    let (netlink_before, text_before) = (netlink.netlink_transactions, netlink.text_transactions);
    text.apply(&transaction).unwrap();
    netlink.apply(&transaction).unwrap();
    assert_eq!((netlink.netlink_transactions, netlink.text_transactions), (netlink_before, text_before + 1));
    assert_eq!(listing(&text_ns), listing(&netlink_ns));

    // A batch the kernel refuses (an element that is not there) fails whole and says which
    // statement failed; what went before it in the batch is not applied.
    let before = listing(&netlink_ns);
    let bad = "add chain inet wasmplane-s0 svc/ns/new\n\
               add rule inet wasmplane-s0 svc/ns/new accept\n\
               delete element inet wasmplane-s0 service-ips { 10.96.9.9 . tcp . 80 }\n";
    let err = netlink.apply(bad).expect_err("deleting a missing element must fail").to_string();
    assert!(
        err.contains("delete element inet wasmplane-s0 service-ips") && err.contains("No such file or directory"),
        "{err}"
    );
    assert_eq!(listing(&netlink_ns), before, "a failed batch changed the table");
    // The socket is usable afterwards.
    netlink.apply("add chain inet wasmplane-s0 svc/ns/new\n").unwrap();
    assert!(listing(&netlink_ns).contains("chain svc/ns/new {"));
}

/// A node upgraded from a host that kept every service in the main table: the new host's
/// first full sync moves the services into shards and removes the old service chains, maps
/// and NAT base chains from the main table, in one transaction.
#[test]
fn an_upgrade_from_one_table_moves_services_into_shards() {
    require_root!();
    let ns = Netns::new(unique_prefix("nl-upgrade"));
    // What a host before shards wrote: the service NAT part in `inet wasmplane`.
    let t = "inet wasmplane";
    let before = format!(
        "add table {t}\n\
         add map {t} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; }}\n\
         add map {t} service-ips6 {{ type ipv6_addr . inet_proto . inet_service : verdict; }}\n\
         add map {t} service-nodeports {{ type inet_proto . inet_service : verdict; }}\n\
         add chain {t} nat-prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}\n\
         add chain {t} nat-output {{ type nat hook output priority -100; policy accept; }}\n\
         add chain {t} services\n\
         add chain {t} svc/ns/a\n\
         add rule {t} nat-prerouting jump services\n\
         add rule {t} nat-output jump services\n\
         add rule {t} services ip daddr . meta l4proto . th dport vmap @service-ips\n\
         add rule {t} svc/ns/a meta l4proto tcp dnat ip to 10.244.1.5:8080\n\
         add element {t} service-ips {{ 10.96.0.1 . tcp . 80 : goto svc/ns/a }}\n"
    );
    let mut text = NftCommand::new(ns_command(&ns), vec![]);
    text.apply(&before).unwrap();
    assert!(text.has_table());

    let mut dataplane = Dataplane::new(Box::new(NftCommand::new(ns_command(&ns), vec![])));
    assert!(dataplane.is_held(), "the old rules are kept until state arrives");
    let mut service = ObjectRules::default();
    service.chains.insert("svc/ns/a".into(), vec!["meta l4proto tcp dnat ip to 10.244.1.6:8080".into()]);
    service.elements.insert(("service-ips".into(), "10.96.0.1 . tcp . 80".into()), "goto svc/ns/a".into());
    let stats = dataplane
        .sync(vec![(wasmplane_model::ObjectKey::new("ns", "a"), Some(service))])
        .expect("the first full sync over the old table");
    assert!(stats.full);

    let main = ns.exec(&["nft", "list", "table", "inet", "wasmplane"]);
    for gone in ["chain svc/ns/a", "map service-ips", "chain nat-prerouting", "chain services"] {
        assert!(!main.contains(gone), "{gone} is still in the main table:\n{main}");
    }
    assert!(main.contains("chain masquerading {"), "{main}");
    let shard = ns.exec(&["nft", "list", "table", "inet", "wasmplane-s0"]);
    assert!(
        shard.contains("10.96.0.1 . tcp . 80 : goto svc/ns/a") && shard.contains("dnat ip to 10.244.1.6:8080"),
        "{shard}"
    );
    // The next full sync finds nothing of the old layout.
    dataplane.full_sync(None).expect("a reconcile after the upgrade");
    assert!(!dataplane.last_transaction.contains("delete map inet wasmplane "), "{}", dataplane.last_transaction);
}

#[test]
fn a_refused_element_of_a_long_statement_is_quoted_in_the_error() {
    require_root!();
    let ns = Netns::new(unique_prefix("nl-refused"));
    // A full transaction writes a map's elements in one statement; nft echoes only its
    // first ~1,000 characters.
    let good: Vec<String> =
        (0..300).map(|i| format!("10.96.{}.{} . tcp . 80 : goto svc/ns/a", i / 250, i % 250)).collect();
    let t = "inet wasmplane-test";
    let transaction = format!(
        "add table {t}\n\
         add chain {t} svc/ns/a\n\
         add map {t} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; }}\n\
         add element {t} service-ips {{ {}, 10.96.9.9 . tcp . 80 : goto svc/ns/missing, 10.96.9.10 . tcp . 80 : goto svc/ns/a }}\n",
        good.join(", ")
    );
    let error =
        NftCommand::new(ns_command(&ns), vec![]).apply(&transaction).expect_err("a goto to no chain").to_string();
    assert!(error.contains("No such file or directory"), "{error}");
    assert!(
        error.contains(&format!("add element {t} service-ips {{ … 10.96.9.9 . tcp . 80 : goto svc/ns/missing …")),
        "{error}"
    );
    assert!(error.len() < 1000, "{error}");
    assert!(
        !ns.exec(&["nft", "list", "tables"]).contains("wasmplane-test"),
        "nothing of a refused transaction is applied"
    );
}

/// Service drops logged (`nft::service_drops`): the skeleton's log rules as nft writes them,
/// and as the batch encodes them (the rules of the reject, drop and cluster IP checks written
/// again incrementally, and a no-endpoint drop sent to the drop chain), list the same.
#[test]
fn service_drop_log_rules_encode_as_nft_writes_them() {
    require_root!();
    let (text_ns, netlink_ns, mut text, mut netlink) = twins("nl-dlog-t", "nl-dlog-b");
    let listing = |ns: &Netns| ns.exec(&["nft", "list", "ruleset"]);
    let networks =
        nft::NodeNetworks { service_drop_log: Some(nft::policy::VerdictLog::new(1001)), ..Default::default() };

    let mut state: State = BTreeMap::new();
    state.insert("a", service_a(&["10.244.1.5"]));
    let full = nft::full_transaction(state.values(), &nft::Stale::default(), LAYOUT, &networks);
    text.apply(&full).unwrap();
    netlink.apply(&full).unwrap();
    let table = listing(&netlink_ns);
    assert_eq!(listing(&text_ns), table);
    // Metered per frontend, then limited for the node (`service_drops::log_rules`).
    let metered = |family: &str| {
        let set = if family == "ip" { "service-drop-log" } else { "service-drop-log6" };
        format!(
            "update @{set} {{ {family} daddr . meta l4proto . th dport limit rate 10/second burst 20 packets }} limit rate 100/second burst 200 packets log prefix"
        )
    };
    for logged in [
        format!("{} \"wasmplane-service no-endpoints\" group 1001", metered("ip")),
        format!("{} \"wasmplane-service no-endpoints\" group 1001", metered("ip6")),
        format!("{} \"wasmplane-service no-local-endpoints\" group 1001", metered("ip6")),
        "log prefix \"wasmplane-service source-range\" group 1001".to_string(),
        format!("ip daddr @cluster-ips {} \"wasmplane-service unknown-port\" group 1001", metered("ip")),
        format!("ip6 daddr @service-cidrs6 {} \"wasmplane-service unallocated\" group 1001", metered("ip6")),
    ] {
        assert!(table.contains(&logged), "missing {logged:?} in\n{table}");
    }

    // A Local service without a local endpoint: its drop goes through the drop chain, as a batch.
    let mut local = object(
        &[],
        &[],
        &[("no-endpoint-services", "203.0.113.7 . tcp . 80", "drop"), ("no-endpoint-nodeports", "tcp . 30007", "drop")],
    );
    nft::service_drops::route_drops_through_log(&mut local);
    let mut next = state.clone();
    next.insert("l", local);
    let transaction = delta(&state, &next);
    assert!(transaction.contains(": goto drop-chain"), "{transaction}");
    text.apply(&transaction).unwrap();
    netlink.apply(&transaction).unwrap_or_else(|e| panic!("the batch was refused: {e}:\n{transaction}"));
    assert_eq!(netlink.netlink_transactions, 1, "not sent as netlink:\n{transaction}");
    assert_eq!(listing(&text_ns), listing(&netlink_ns), "after\n{transaction}");
    assert!(listing(&netlink_ns).contains("tcp . 30007 : goto drop-chain"));

    // The log rules themselves, written again: their meters (a dynamic set keyed by a
    // concatenation) are outside the batch's vocabulary, so the transaction goes through
    // `nft -f` whole, and the tables still list alike. Only full syncs write them.
    let mut rewrite = String::new();
    for chain in ["reject-chain", "drop-chain", "cluster-ips-check"] {
        let rule_prefix = format!("add rule inet wasmplane {chain} ");
        rewrite += &format!("flush chain inet wasmplane {chain}\n");
        full.lines().filter(|l| l.starts_with(&rule_prefix)).for_each(|l| rewrite += &format!("{l}\n"));
    }
    assert_eq!(rewrite.matches(" log group 1001 ").count(), 8, "{rewrite}");
    text.apply(&rewrite).unwrap();
    netlink.apply(&rewrite).unwrap_or_else(|e| panic!("the transaction was refused: {e}:\n{rewrite}"));
    assert_eq!(netlink.netlink_transactions, 1, "a meter sent as netlink:\n{rewrite}");
    assert_eq!(listing(&text_ns), listing(&netlink_ns), "the log rules differ after\n{rewrite}");
    assert_eq!(listing(&netlink_ns), {
        // And nothing moved: the tables are as the full transaction left them, plus "l".
        let check = Netns::new(unique_prefix("nl-dlog-c"));
        let mut fresh = NftCommand::new(ns_command(&check), vec![]);
        fresh.apply(&nft::full_transaction(next.values(), &nft::Stale::default(), LAYOUT, &networks)).unwrap();
        listing(&check)
    });
}

/// Allow logging (`nft::policy::allow_logged_object`): a policy's accepts sent to its allow
/// chains, whose log rules meter each pod in a dynamic set (`update @set { ip daddr limit … }`),
/// are written incrementally as one netlink batch, list as nft writes them, and go away again.
#[test]
fn allow_logged_policies_encode_as_netlink_with_their_per_pod_meters() {
    require_root!();
    let (text_ns, netlink_ns, mut text, mut netlink) = twins("nl-allow-t", "nl-allow-b");
    let listing = |ns: &Netns| ns.exec(&["nft", "list", "ruleset"]);

    let key = wasmplane_model::ObjectKey::new("ns", "p");
    let pod: std::net::IpAddr = "10.244.0.5".parse().unwrap();
    let mut egress = policy(&["10.244.0.7"]);
    egress
        .chains
        .insert("pol/ns/p/out".into(), vec!["ip daddr 10.0.0.0/8 meta l4proto tcp th dport 443 accept".into()]);
    let rules = nft::policy::PolicyRules {
        rules: egress,
        shared: BTreeMap::new(),
        targets: [
            ((nft::policy::Direction::Ingress, pod), "pol/ns/p/in".to_string()),
            ((nft::policy::Direction::Egress, pod), "pol/ns/p/out".to_string()),
        ]
        .into(),
    };
    let mut state: State = BTreeMap::new();
    state.insert("p", rules.rules.clone());
    state.insert("d", dispatch());
    let full = nft::full_transaction(state.values(), &nft::Stale::default(), LAYOUT, &nft::NodeNetworks::default());
    text.apply(&full).unwrap();
    netlink.apply(&full).unwrap();
    assert_eq!(listing(&text_ns), listing(&netlink_ns));

    let mut logged = state.clone();
    logged.insert("p", nft::policy::allow_logged_object(&key, &rules, nft::policy::VerdictLog::new(1001)));
    for (what, from, to) in [("allow logging on", &state, &logged), ("and off", &logged, &state)] {
        let transaction = delta(from, to);
        let before = netlink.netlink_transactions;
        text.apply(&transaction).unwrap_or_else(|e| panic!("{what}: nft -f refused {e}:\n{transaction}"));
        netlink.apply(&transaction).unwrap_or_else(|e| panic!("{what}: the batch was refused: {e}:\n{transaction}"));
        assert_eq!(netlink.netlink_transactions, before + 1, "{what}: not sent as netlink:\n{transaction}");
        assert_eq!(listing(&text_ns), listing(&netlink_ns), "{what}: the tables differ after\n{transaction}");
        if what == "allow logging on" {
            let table = listing(&netlink_ns);
            for metered in [
                "update @policy-allow-log-ingress { ip daddr limit rate 10/second burst 20 packets } limit rate 100/second burst 200 packets log prefix",
                "update @policy-allow-log-egress6 { ip6 saddr limit rate 10/second burst 20 packets } limit rate 100/second burst 200 packets log prefix",
            ] {
                assert!(table.contains(metered), "missing {metered:?} in\n{table}");
            }
        }
    }
    assert!(!listing(&netlink_ns).contains("polallow/"), "the allow chains are gone");
}

/// A host restarted without logging service drops, over the tables of one that logged them:
/// its first full sync deletes the drop chain (`flush table` leaves it, empty), in the same
/// transaction that rewrites the no-endpoint elements that went to it.
#[test]
fn a_full_sync_without_service_drop_logging_deletes_the_drop_chain() {
    require_root!();
    let ns = Netns::new(unique_prefix("nl-dchain"));
    let key = wasmplane_model::ObjectKey::new("ns", "local");
    let local = |logged: bool| {
        let mut r = object(&[], &[], &[("no-endpoint-nodeports", "tcp . 30007", "drop")]);
        if logged {
            nft::service_drops::route_drops_through_log(&mut r);
        }
        r
    };
    let main = || ns.exec(&["nft", "list", "table", "inet", "wasmplane"]);

    let mut logging = Dataplane::new(Box::new(NftCommand::new(ns_command(&ns), vec![])))
        .with_service_drop_log(Some(nft::policy::VerdictLog::new(1001)));
    logging.full_sync(Some([(key.clone(), local(true))].into())).expect("the logging run's full sync");
    let table = main();
    assert!(table.contains("chain drop-chain {") && table.contains("tcp . 30007 : goto drop-chain"), "{table}");

    let mut restarted = Dataplane::new(Box::new(NftCommand::new(ns_command(&ns), vec![])));
    assert!(restarted.is_held());
    restarted.full_sync(Some([(key, local(false))].into())).unwrap();
    assert!(restarted.release().expect("the full sync without logging").full);
    let table = main();
    assert!(!table.contains("drop-chain") && table.contains("tcp . 30007 : drop"), "{table}");
    assert!(table.contains("chain reject-chain {"), "{table}");
    // The next full sync has nothing of it left to delete.
    restarted.full_sync(None).unwrap();
    assert!(!restarted.last_transaction.contains("delete chain"), "{}", restarted.last_transaction);
}
