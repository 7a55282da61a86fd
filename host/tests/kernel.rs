//! The nftables writer against the real kernel, inside a network namespace made here:
//! every transaction the host renders (full, incremental, reconcile) must be accepted,
//! and what is in the kernel must match what the host says is applied.

use std::process::Command;
use std::time::{Duration, Instant};

use wasmplane::app::{DataplaneMode, HostConfig, start};

mod support;
use support::netns::require_root;
use support::set_holds;

const TOKEN: &str = "kernel-test-token-0123456789";

struct Netns(String);

impl Netns {
    fn new(name: &str) -> Option<Netns> {
        let _ = Command::new("ip").args(["netns", "del", name]).status();
        Command::new("ip").args(["netns", "add", name]).status().ok()?.success().then(|| Netns(name.into()))
    }
    fn nft(&self, args: &[&str]) -> String {
        let out = Command::new("ip").args(["netns", "exec", &self.0, "nft"]).args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A host over `manifests` writing its tables in `ns`, one service to a shard (the services
/// spread over several tables).
async fn host_in(ns: &Netns, manifests: &std::path::Path, dir: &std::path::Path) -> wasmplane::app::RunningHost {
    start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        manifests: Some(manifests.into()),
        data_dir: Some(dir.join("data")),
        token: Some(TOKEN.into()),
        dataplane: DataplaneMode::Nftables,
        nft_command: vec!["ip".into(), "netns".into(), "exec".into(), ns.0.clone(), "nft".into()],
        manifest_poll: Duration::from_millis(50),
        nft_services_per_shard: 1,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A namespace `<tag>-<pid>` (`Netns::new` deletes one of that name first, another run's too),
/// a temporary directory whose `manifests/` holds `examples` from examples/manifests, and a
/// host writing into the namespace from them.
async fn host_on_examples(
    tag: &str,
    examples: &[&str],
) -> (Netns, tempfile::TempDir, std::path::PathBuf, wasmplane::app::RunningHost) {
    let ns = Netns::new(&format!("{tag}-{}", std::process::id())).expect("creating a network namespace");
    let dir = tempfile::tempdir().unwrap();
    let manifests = dir.path().join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    for f in examples {
        std::fs::copy(format!("{}/../examples/manifests/{f}", env!("CARGO_MANIFEST_DIR")), manifests.join(f)).unwrap();
    }
    let host = host_in(&ns, &manifests, dir.path()).await;
    (ns, dir, manifests, host)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_apply_to_the_kernel_and_reconcile_repairs_drift() {
    require_root!();
    let (ns, dir, manifests, host) = host_on_examples("wp-kernel", &["cluster.yaml", "shop.yaml", "pods.yaml"]).await;
    let wait_for = |what: &'static str, cond: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let table = ns.nft(&["list", "ruleset"]);
            if cond(&table) {
                return table;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}:\n{table}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // Full sync of the example cluster: ClusterIP, affinity sets, NodePort, UDP.
    let table = wait_for("initial sync", &|t| {
        t.contains("10.96.0.20 . tcp . 80 : goto pick-by-count") && set_holds(t, "frontends-3", "10.96.0.20 . tcp . 80")
    });
    // web as data: its three backends by number in its shard's endpoint map, no chain.
    assert!(
        table.contains("10.96.0.20 . tcp . 80 . 2 : 10.244.1.11 . 8080") && !table.contains("chain svc/shop/web/"),
        "{table}"
    );
    // api's session affinity as data: its frontend to the shard's chain for 600 s, which
    // goes on by its backend count and remembers clients in the shard's slot sets.
    assert!(
        table.contains("10.96.0.21 . tcp . 443 : goto affinity-600-pick-by-count")
            && table.contains("chain affinity-600-lookup {"),
        "{table}"
    );
    assert!(table.contains("set affinity-slot-0 {") && !table.contains("chain svc/shop/api/"), "{table}");
    assert!(table.contains("10.244.0.12 . 10.244.0.12"), "hairpin endpoints: {table}");
    assert!(
        table.contains("tcp . 30080 : goto svc/shop/web/tcp/http")
            || table.contains("tcp . 30080 : goto svc/shop/checkout/tcp/http/external"),
        "{table}"
    );
    assert!(table.contains("10.96.0.10 . udp . 53"), "{table}");

    // Incremental: scale web down to one endpoint.
    let shop = std::fs::read_to_string(manifests.join("shop.yaml")).unwrap();
    let scaled = shop.replace("  - { addresses: [10.244.0.12], conditions: { ready: true, serving: true, terminating: false }, nodeName: node-a, zone: zone-1 }\n", "");
    assert_ne!(shop, scaled);
    // Written beside and renamed in: a poll that read a half-written (say empty) file would
    // also satisfy "10.244.0.12 gone".
    std::fs::write(dir.path().join("shop.yaml.tmp"), &scaled).unwrap();
    std::fs::rename(dir.path().join("shop.yaml.tmp"), manifests.join("shop.yaml")).unwrap();
    let table = wait_for("scale-down", &|t| !t.contains("10.244.0.12"));
    // A draw between the two left: renumbered backends, the frontend counted as two.
    assert!(
        set_holds(&table, "frontends-2", "10.96.0.20 . tcp . 80")
            && !set_holds(&table, "frontends-3", "10.96.0.20 . tcp . 80"),
        "{table}"
    );
    assert!(
        table.contains("10.96.0.20 . tcp . 80 : goto pick-by-count")
            && table.contains("10.96.0.20 . tcp . 80 . 1 : 10.244.1.11 . 8080"),
        "{table}"
    );
    assert!(!table.contains("10.96.0.20 . tcp . 80 . 2 "), "{table}");
    // The remaining endpoint is still a hairpin endpoint; the gone one left the set.
    assert!(table.contains("10.244.0.11 . 10.244.0.11"), "{table}");
    // Incremental changes go in as netlink batches (no nft process; see nft/netlink.rs).
    let metrics = reqwest::get(format!("{}/metrics", host.url())).await.unwrap().text().await.unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("wasmplane_dataplane_transactions_total{path=\"netlink\"} ") && !l.ends_with(" 0")),
        "{metrics}"
    );

    // Services are spread over shard tables, each with its own NAT chains and maps.
    let layout = host.controller.lock().unwrap().dataplane().layout();
    assert!(layout.shards > 1, "{layout:?}");
    let web = layout.table_of("svc/shop/web/tcp/http").name();
    let table = ns.nft(&["list", "ruleset"]);
    let shards_with_services =
        table.split("\ntable ").filter(|t| t.starts_with("inet wasmplane-s") && t.contains(" : goto ")).count();
    assert!(shards_with_services > 1, "services in {shards_with_services} shard table(s):\n{table}");
    let web_table = table
        .split("\ntable ")
        .find(|t| t.starts_with(&format!("inet {web} {{")))
        .unwrap_or_else(|| panic!("no table {web}:\n{table}"));
    assert!(
        set_holds(web_table, "frontends-2", "10.96.0.20 . tcp . 80") && web_table.contains("type nat hook prerouting"),
        "{web_table}"
    );

    // Drift: someone empties two of our chains and deletes the elements that lead to them;
    // the reconcile puts them back.
    let rendered = host.controller.lock().unwrap().dataplane().render();
    let nft =
        |args: &[&str]| Command::new("ip").args(["netns", "exec", &ns.0, "nft"]).args(args).status().unwrap().success();
    assert!(nft(&["delete", "element", "inet", &web, "service-ips", "{ 10.96.0.20 . tcp . 80 }"]));
    assert!(nft(&["delete", "element", "inet", &web, "frontends-2", "{ 10.96.0.20 . tcp . 80 }"]));
    assert!(
        nft(&["flush", "chain", "inet", &web, "pick-by-count"]) && nft(&["flush", "chain", "inet", &web, "pick-2"])
    );
    let table = ns.nft(&["list", "ruleset"]);
    assert!(
        !table.contains("10.96.0.20 . tcp . 80 : goto") && !set_holds(&table, "frontends-2", "10.96.0.20 . tcp . 80"),
        "{table}"
    );
    host.controller.lock().unwrap().reconcile().unwrap();
    let table = ns.nft(&["list", "ruleset"]);
    let web_table = table.split("\ntable ").find(|t| t.starts_with(&format!("inet {web} {{"))).unwrap();
    assert!(
        web_table.contains("10.96.0.20 . tcp . 80 : goto pick-by-count")
            && set_holds(web_table, "frontends-2", "10.96.0.20 . tcp . 80"),
        "{web_table}"
    );
    assert!(
        web_table.contains("@frontends-2 goto pick-2")
            && web_table.contains("numgen random mod 2 map @service-endpoints"),
        "{web_table}"
    );
    assert_eq!(host.controller.lock().unwrap().dataplane().render(), rendered);

    // A module swap is one transaction too: the port filter keeps only api (labelled).
    let r = reqwest::Client::new()
        .put(format!("{}/v1/modules/port-filter?kind=service-translator", host.url()))
        .bearer_auth(TOKEN)
        .body(wasmplane_guest_artifacts::examples::PORT_FILTER_TRANSLATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let table = ns.nft(&["list", "ruleset"]);
    assert!(!table.contains("svc/shop/web"), "stale chains must be gone:\n{table}");
    assert!(table.contains("chain svc/shop/api/tcp/443 {"), "{table}");
    host.stop().await;
    // Stopping the host leaves the rules in place (no window on restart).
    assert!(ns.nft(&["list", "ruleset"]).contains("chain svc/shop/api/tcp/443 {"));
}

/// `wasmplane cleanup` (kube-proxy's `--cleanup`) run in a node's namespace after the host
/// stopped: every table of ours and every route of our protocol go, IPv4 and IPv6, and the
/// CNI configuration named; another table and a route of another protocol stay; a second run
/// finds nothing and is no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_our_tables_and_routes_and_nothing_else() {
    require_root!("network namespaces, nftables, routes");
    let (ns, dir, _manifests, host) = host_on_examples("wp-cleanup", &["shop.yaml"]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ns.nft(&["list", "tables"]).contains("wasmplane-s1") {
        assert!(Instant::now() < deadline, "the host wrote no shards: {}", ns.nft(&["list", "tables"]));
        std::thread::sleep(Duration::from_millis(50));
    }
    // Stopped: the rules stay (as kube-proxy's), which is what cleanup is for.
    host.stop().await;
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(["netns", "exec", &ns.0, "ip"]).args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ip(&["link", "set", "lo", "up"]);
    // Routes as the agent writes them (protocol 149), and someone else's.
    ip(&["route", "add", "10.244.5.0/24", "dev", "lo", "proto", "149"]);
    ip(&["-6", "route", "add", "fd00:10:244:5::/64", "dev", "lo", "proto", "149"]);
    ip(&["route", "add", "10.244.6.0/24", "dev", "lo", "proto", "static"]);
    ns.nft(&["add", "table", "inet", "someone-else"]);
    let conf = dir.path().join("10-wasmplane.conflist");
    std::fs::write(&conf, "{}").unwrap();

    let cleanup = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.0, env!("CARGO_BIN_EXE_wasmplane"), "cleanup", "--cni-conf"])
            .arg(&conf)
            .output()
            .unwrap();
        assert!(out.status.success(), "cleanup failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let said = cleanup();
    assert!(said.contains("inet wasmplane,") || said.contains("inet wasmplane\n"), "{said}");
    assert!(
        said.contains("inet wasmplane-s1") && said.contains("10.244.5.0/24") && said.contains("fd00:10:244:5::/64"),
        "{said}"
    );
    let tables = ns.nft(&["list", "tables"]);
    assert_eq!(tables.trim(), "table inet someone-else", "only someone else's table stays");
    let routes = ip(&["route", "show"]) + &ip(&["-6", "route", "show"]);
    assert!(!routes.contains("10.244.5.0/24") && !routes.contains("fd00:10:244:5::/64"), "{routes}");
    assert!(routes.contains("10.244.6.0/24"), "someone else's route stays: {routes}");
    assert!(!conf.exists(), "the CNI configuration is removed");

    let again = cleanup();
    assert!(again.contains("tables removed: none") && again.contains("routes removed: none"), "{again}");
}
