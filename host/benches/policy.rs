//! Network-policy benchmark (issue 6): N policies over 5,000 pods (100 of them on this node),
//! the builtin policy guest running as Wasm, through the host's policy controller and writer:
//!
//! - full compile: every object applied at once → model → every policy selecting a local pod
//!   compiled → one full transaction (its size in statements);
//! - one pod label change: a local pod moves between apps, so it enters and leaves policies
//!   as target and as peer: event → model → recompiled policies → incremental transaction
//!   (median of 7; policies recompiled and statements written per change).
//!
//! The writer renders into the recorder (CPU only) and, as root, also writes into a network
//! namespace made for the run (kernel included). `cargo bench -p wasmplane --bench policy`;
//! sizes from `WASMPLANE_BENCH_POLICIES` (default `1000,10000`).

use std::process::Command;
use std::time::{Duration, Instant};

use wasmplane::dataplane::{Dataplane, Kernel, NetlinkNft, NftCommand, Recorder};
use wasmplane::policy::PolicyController;
use wasmplane_model::state::{ClusterEvent, ClusterObject};
use wasmplane_model::*;
use wasmplane_runtime::{Limits, Runtime};

const PODS: usize = 5_000;
const NAMESPACES: usize = 50;
const APPS: usize = 20;
const NODE: &str = "node-a";

fn labels(pairs: &[(&str, String)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).into(), v.into())).collect()
}

fn select(pairs: &[(&str, String)]) -> LabelSelector {
    LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
}

fn pod(i: usize, app: usize) -> ClusterObject {
    // 100 pods on this node, spread over every namespace.
    let local = (i / NAMESPACES).is_multiple_of(NAMESPACES);
    ClusterObject::Pod(Pod {
        namespace: format!("ns{}", i % NAMESPACES).into(),
        name: format!("pod{i}").into(),
        ips: vec![format!("10.244.{}.{}", i / 250, i % 250 + 1).into()],
        node_name: Some(if local { NODE.into() } else { format!("node-{}", i % 40 + 1).into() }),
        labels: labels(&[("app", format!("a{app}"))]),
        ports: vec![ContainerPort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 8080,
            host_port: None,
            host_ip: None,
        }],
        host_network: false,
    })
}

fn policy(i: usize) -> ClusterObject {
    let rule = |peers: Vec<PolicyPeer>| PolicyRule {
        ports: vec![PolicyPort {
            protocol: Protocol::Tcp,
            port: PolicyPortNumber::Name("http".into()),
            end_port: None,
        }],
        peers,
    };
    ClusterObject::NetworkPolicy(NetworkPolicy {
        namespace: format!("ns{}", i % NAMESPACES).into(),
        name: format!("pol{i}").into(),
        uid: format!("uid-{i}").into(),
        generation: 1,
        pod_selector: select(&[("app", format!("a{}", i % APPS))]),
        ingress: Some(vec![
            rule(vec![PolicyPeer {
                pod_selector: Some(select(&[("app", format!("a{}", (i + 1) % APPS))])),
                namespace_selector: None,
                ip_block: None,
            }]),
            rule(vec![PolicyPeer {
                pod_selector: Some(select(&[("app", format!("a{}", (i + 3) % APPS))])),
                namespace_selector: Some(select(&[("team", format!("t{}", i % 5))])),
                ip_block: None,
            }]),
        ]),
        egress: None,
    })
}

struct Bench {
    cluster: ClusterState,
    model: NodeLocalModel,
    policy: PolicyController,
    dataplane: Dataplane,
}

impl Bench {
    /// Applies `events`; returns (policies compiled, statements written).
    fn apply(&mut self, events: Vec<ClusterEvent>, full: bool) -> (usize, usize) {
        let mut touched = wasmplane_model::state::Touched::default();
        for e in events {
            touched.merge(self.cluster.apply(e, NODE));
        }
        let update = self.model.update(&self.cluster, &touched);
        let changes = self.policy.apply(&self.cluster, &self.model, &update, self.dataplane.pod_detection());
        assert_eq!(changes.failed, 0, "compile failures");
        let compiled = changes.compiled;
        let stats = if full {
            self.dataplane.full_sync(Some(self.policy.objects().into_iter().collect())).expect("full sync")
        } else {
            self.dataplane.sync(changes.changes).expect("sync")
        };
        (compiled, stats.statements)
    }
}

fn run(n: usize, kernel: Box<dyn Kernel>, runtime: &Runtime) -> (Duration, usize, usize, Duration, usize, usize) {
    let module = runtime.load_policy("bench", wasmplane_guest_artifacts::NETWORK_POLICY, usize::MAX).unwrap();
    let mut bench = Bench {
        cluster: ClusterState::new(),
        model: NodeLocalModel::new(NODE, vec!["10.244.0.0/16".into()]),
        policy: PolicyController::new(&module),
        dataplane: Dataplane::new(kernel),
    };
    let mut events: Vec<ClusterEvent> = (0..NAMESPACES)
        .map(|i| {
            ClusterEvent::Upsert(ClusterObject::Namespace(Namespace {
                name: format!("ns{i}").into(),
                labels: labels(&[("team", format!("t{}", i % 5))]),
            }))
        })
        .collect();
    events.extend((0..PODS).map(|i| ClusterEvent::Upsert(pod(i, i % APPS))));
    events.extend((0..n).map(|i| ClusterEvent::Upsert(policy(i))));
    let started = Instant::now();
    let (compiled, statements) = bench.apply(events, true);
    let full = started.elapsed();

    // Pod 7 (local, ns7) flips between apps a7 and a8.
    let mut samples = Vec::new();
    let (mut recompiled, mut written) = (0, 0);
    for round in 0..7 {
        let app = if round % 2 == 0 { 8 } else { 7 };
        let started = Instant::now();
        let (c, s) = bench.apply(vec![ClusterEvent::Upsert(pod(7, app))], false);
        samples.push(started.elapsed());
        (recompiled, written) = (c, s);
    }
    samples.sort();
    (full, compiled, statements, samples[samples.len() / 2], recompiled, written)
}

fn main() {
    let sizes: Vec<usize> = std::env::var("WASMPLANE_BENCH_POLICIES")
        .ok()
        .map(|s| s.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000]);
    let runtime = Runtime::new(Limits { call_timeout: Duration::from_secs(5), ..Default::default() }, None).unwrap();
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    println!(
        "{PODS} pods ({} on this node), {NAMESPACES} namespaces; builtin policy guest as Wasm\n",
        PODS / NAMESPACES
    );
    println!(
        "| policies | writer | full compile + sync | policies compiled | statements | one label change (median of 7) | policies recompiled | statements written |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &n in &sizes {
        let mut kernels: Vec<(&str, Box<dyn Kernel>, Option<String>)> =
            vec![("render only", Box::new(Recorder::default()), None)];
        if root {
            let ns = format!("wpbench-pol-{}-{n}", std::process::id());
            let _ = Command::new("ip").args(["netns", "add", &ns]).status();
            let nft: Vec<String> = vec!["ip".into(), "netns".into(), "exec".into(), ns.clone(), "nft".into()];
            kernels.push(("`nft -f` in a netns", Box::new(NftCommand::new(nft.clone(), vec![])), Some(ns.clone())));
            // As the host writes: changes as netlink batches (a fresh namespace each).
            let ns = format!("{ns}-nl");
            let _ = Command::new("ip").args(["netns", "add", &ns]).status();
            let nft: Vec<String> = vec!["ip".into(), "netns".into(), "exec".into(), ns.clone(), "nft".into()];
            let netns = NetlinkNft::netns_of_command(&nft);
            kernels.push((
                "netlink in a netns",
                Box::new(NetlinkNft::open(NftCommand::new(nft, vec![]), netns.as_deref()).expect("netlink socket")),
                Some(ns),
            ));
        }
        for (what, kernel, ns) in kernels {
            let (full, compiled, statements, change, recompiled, written) = run(n, kernel, &runtime);
            println!(
                "| {n} | {what} | {:.2} s | {compiled} | {statements} | {:.1} ms | {recompiled} | {written} |",
                full.as_secs_f64(),
                change.as_secs_f64() * 1e3
            );
            if let Some(ns) = ns {
                let _ = Command::new("ip").args(["netns", "del", &ns]).status();
            }
        }
    }
    if !root {
        println!("\n(not root: the kernel rows were skipped)");
    }
}
