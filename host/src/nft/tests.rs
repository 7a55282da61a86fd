use super::*;
use wasmplane_runtime::wit::*;

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
    MapElement { map_name: map.into(), key: vec![KeyPart::Address(ip.into()), KeyPart::Protocol(Protocol::Tcp), KeyPart::Port(80)], verdict }
}

#[test]
fn renders_valid_output() {
    let out = ruleset(vec![dnat_chain("svc/shop/web/tcp/http", "10.244.0.11")], vec![element("service-ips", "10.96.0.20", Verdict::Goto("svc/shop/web/tcp/http".into()))]);
    let rules = validate_service_output(&key(), &out).unwrap();
    assert_eq!(rules.chains["svc/shop/web/tcp/http"], vec!["meta l4proto tcp dnat ip to 10.244.0.11:8080".to_string()]);
    assert_eq!(rules.elements[&("service-ips".to_string(), "10.96.0.20 . tcp . 80".to_string())], "goto svc/shop/web/tcp/http");
    let text = full_transaction([&rules].into_iter(), &[], &[]);
    assert!(text.contains("add element inet wasmplane service-ips { 10.96.0.20 . tcp . 80 : goto svc/shop/web/tcp/http }"));
    let flush = text.find("flush table inet wasmplane").unwrap();
    assert!(text.find("add map inet wasmplane service-ips ").unwrap() < flush, "maps exist before they are flushed");
    assert!(text.find("flush map inet wasmplane service-ips\n").unwrap() > flush);
}

#[test]
fn ipv6_keys_go_to_the_v6_map() {
    let out = ruleset(vec![dnat_chain("svc/shop/web/tcp/http", "fd00::11")], vec![element("service-ips", "fd00:96::20", Verdict::Goto("svc/shop/web/tcp/http".into()))]);
    let rules = validate_service_output(&key(), &out).unwrap();
    assert!(rules.elements.contains_key(&("service-ips6".to_string(), "fd00:96::20 . tcp . 80".to_string())));
    assert_eq!(rules.chains["svc/shop/web/tcp/http"][0], "meta l4proto tcp dnat ip6 to [fd00::11]:8080");
}

#[test]
fn rejects_what_is_not_its_own_or_not_well_formed() {
    let cases = vec![
        (ruleset(vec![dnat_chain("svc/shop/other/x", "10.244.0.1")], vec![]), "outside"),
        (ruleset(vec![dnat_chain("evil", "10.244.0.1")], vec![]), "outside"),
        (ruleset(vec![dnat_chain("svc/shop/web/x; flush ruleset", "10.244.0.1")], vec![]), "not a valid identifier"),
        (ruleset(vec![dnat_chain("svc/shop/web/x", "10.244.0.1 ; drop")], vec![]), "not an IP address"),
        (ruleset(vec![], vec![element("service-ips", "10.96.0.20", Verdict::Goto("svc/shop/web/missing".into()))]), "does not declare"),
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
    let old = validate_service_output(&key(), &ruleset(vec![dnat_chain(chain, "10.244.0.11"), dnat_chain("svc/shop/web/gone", "10.244.0.12")], vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into()))])).unwrap();
    let new = validate_service_output(&key(), &ruleset(vec![dnat_chain(chain, "10.244.0.13")], vec![element("service-ips", "10.96.0.20", Verdict::Goto(chain.into()))])).unwrap();
    let mut out = String::new();
    object_delta(&old, &new, &mut out);
    let lines: Vec<&str> = out.lines().collect();
    // The unchanged element is left alone; the changed chain is flushed and refilled; the
    // removed chain is flushed before it is deleted.
    assert!(!out.contains("element"), "{out}");
    let pos = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap_or_else(|| panic!("{needle} missing in {out}"));
    assert!(pos("flush chain inet wasmplane svc/shop/web/gone") < pos("delete chain inet wasmplane svc/shop/web/gone"));
    assert!(pos(&format!("flush chain inet wasmplane {chain}")) < pos("dnat ip to 10.244.0.13:8080"));
    let mut nothing = String::new();
    object_delta(&new, &new, &mut nothing);
    assert!(nothing.is_empty());
}
