//! The model alone under pod churn, with and without network policies (BENCHMARKS.md,
//! twenty-seventh run): a cluster of the perf harness's shape (100 services per namespace,
//! 1–2 pods per service, 30 pods per node; policy `j` selects service `j`'s pods and allows
//! service `7j + 1`'s from any namespace), loaded one event at a time, then pods replaced one
//! by one (a create and a delete each), through `ClusterState::apply` and
//! `NodeLocalModel::update`. No guest, no kernel: what the model's indexes and views cost.
//!
//! `cargo bench -p wasmplane-model --bench pod_events`; sizes from `WASMPLANE_BENCH_SERVICES`
//! (default `1000,10000`) and `WASMPLANE_BENCH_POLICIES` (default `0,1000`), and
//! `WASMPLANE_BENCH_PEER_KEYS` (default `1`): how many different label keys the policies' peers
//! select on. Service `s`'s pods carry `app: svc-s`, and for `K` keys also `app-{s % K}: svc-s`
//! (`s % K` > 0), which is the key a peer naming service `s` requires: many teams' label
//! schemes in one cluster, each key filed by the pod index.

use std::time::{Duration, Instant};

use wasmplane_model::*;

const NODE: &str = "node-0";
/// Pods replaced per pass; each is two events.
const REPLACEMENTS: usize = 3_000;
const PASSES: usize = 3;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
}

fn selector(pairs: &[(&str, &str)]) -> LabelSelector {
    LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
}

struct Cluster {
    services: usize,
    namespaces: usize,
    nodes: usize,
    /// Label keys the policies' peers select on.
    peer_keys: usize,
    /// Pods made so far: names and IPs stay unique.
    made: usize,
}

impl Cluster {
    fn pod(&mut self, service: usize) -> Pod {
        let n = self.made;
        self.made += 1;
        Pod {
            namespace: format!("ns-{}", service % self.namespaces).into(),
            name: format!("svc-{service}-{n}").into(),
            ips: vec![format!("10.{}.{}.{}", 64 + n / 65_536, n / 256 % 256, n % 256).into()],
            // Spread over the nodes by a stride coprime to their count in practice.
            node_name: Some(format!("node-{}", n * 7_919 % self.nodes).into()),
            labels: match self.peer_key(service) {
                key if key == "app" => labels(&[("app", &format!("svc-{service}")), ("version", "v1")]),
                key => {
                    labels(&[("app", &format!("svc-{service}")), (&key, &format!("svc-{service}")), ("version", "v1")])
                }
            },
            ports: vec![],
            host_network: false,
        }
    }

    /// The key a peer naming `service`'s pods requires.
    fn peer_key(&self, service: usize) -> String {
        match service % self.peer_keys {
            0 => "app".into(),
            k => format!("app-{k}"),
        }
    }

    fn policy(&self, j: usize) -> NetworkPolicy {
        let (target, peer) = (j % self.services, (j * 7 + 1) % self.services);
        NetworkPolicy {
            namespace: format!("ns-{}", target % self.namespaces).into(),
            name: format!("allow-{j}").into(),
            uid: CompactString::default(),
            generation: 1,
            pod_selector: selector(&[("app", &format!("svc-{target}"))]),
            ingress: Some(vec![PolicyRule {
                ports: vec![],
                peers: vec![PolicyPeer {
                    pod_selector: Some(selector(&[(&self.peer_key(peer), &format!("svc-{peer}"))])),
                    namespace_selector: Some(selector(&[])),
                    ip_block: None,
                }],
            }]),
            egress: None,
        }
    }
}

struct Row {
    services: usize,
    policies: usize,
    peer_keys: usize,
    load: Duration,
    per_event: Duration,
    touched_per_event: f64,
    views: usize,
}

fn run(services: usize, policies: usize, peer_keys: usize) -> Row {
    let mut cluster = Cluster {
        services,
        namespaces: (services / 100).max(1),
        nodes: (services * 3 / 2 / 30).max(1),
        peer_keys,
        made: 0,
    };
    let mut state = ClusterState::new();
    let mut model = NodeLocalModel::new(NODE, vec!["10.64.0.0/10".into()]);
    let apply = |state: &mut ClusterState, model: &mut NodeLocalModel, event: ClusterEvent| {
        let touched = state.apply(event, NODE);
        model.update(state, &touched);
        touched.policies.len()
    };
    let started = Instant::now();
    for n in 0..cluster.namespaces {
        let name = format!("ns-{n}");
        apply(
            &mut state,
            &mut model,
            ClusterEvent::Upsert(ClusterObject::Namespace(Namespace {
                name: name.as_str().into(),
                labels: labels(&[("kubernetes.io/metadata.name", &name)]),
            })),
        );
    }
    for j in 0..policies {
        apply(&mut state, &mut model, ClusterEvent::Upsert(ClusterObject::NetworkPolicy(cluster.policy(j))));
    }
    let mut pods: Vec<(usize, ObjectKey)> = Vec::new();
    for service in 0..services {
        for _ in 0..1 + service % 2 {
            let pod = cluster.pod(service);
            pods.push((service, pod.key()));
            apply(&mut state, &mut model, ClusterEvent::Upsert(ClusterObject::Pod(pod)));
        }
    }
    let load = started.elapsed();

    let mut best = Duration::MAX;
    let mut touched = 0;
    for pass in 0..PASSES {
        let started = Instant::now();
        touched = 0;
        for k in 0..REPLACEMENTS {
            let at = (pass * REPLACEMENTS + k) * 104_729 % pods.len();
            let (service, old) = pods[at].clone();
            let pod = cluster.pod(service);
            pods[at] = (service, pod.key());
            touched += apply(&mut state, &mut model, ClusterEvent::Upsert(ClusterObject::Pod(pod)));
            touched += apply(&mut state, &mut model, ClusterEvent::Delete(ObjectKind::Pod, old));
        }
        best = best.min(started.elapsed());
    }
    let events = 2 * REPLACEMENTS;
    Row {
        services,
        policies,
        peer_keys,
        load,
        per_event: best / events as u32,
        touched_per_event: touched as f64 / events as f64,
        views: model.policies.len(),
    }
}

fn sizes(var: &str, default: &str) -> Vec<usize> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().parse().expect("a comma-separated list of numbers"))
        .collect()
}

fn main() {
    println!(
        "| services | policies | peer label keys | load, one event each (ms) | one pod event (µs, best of {PASSES} passes of {} events) | policies touched per event | policies with a view on this node |",
        2 * REPLACEMENTS
    );
    println!("|---|---|---|---|---|---|---|");
    for services in sizes("WASMPLANE_BENCH_SERVICES", "1000,10000") {
        for (policies, peer_keys) in sizes("WASMPLANE_BENCH_POLICIES", "0,1000")
            .into_iter()
            .flat_map(|p| sizes("WASMPLANE_BENCH_PEER_KEYS", "1").into_iter().map(move |k| (p, k.max(1))))
        {
            let row = run(services, policies, peer_keys);
            println!(
                "| {} | {} | {} | {:.1} | {:.2} | {:.2} | {} |",
                row.services,
                row.policies,
                row.peer_keys,
                row.load.as_secs_f64() * 1e3,
                row.per_event.as_secs_f64() * 1e6,
                row.touched_per_event,
                row.views
            );
        }
    }
}
