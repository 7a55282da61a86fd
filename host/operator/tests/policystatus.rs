//! Policy status aggregation: 200 policies × 50 nodes of per-node status in the
//! kvstore become a bounded number of API-server writes, counted by the test
//! API server (kube's real client, real merge patches on NetworkPolicies).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use tokio::time::Instant;
use wasmplane_kvstore::{EmbeddedStore, KvStore};
use wasmplane_operator::policystatus::{POLICY_STATUS_ANNOTATION, POLICY_STATUS_PREFIX};
use wasmplane_operator::{
    AggregatorConfig, Leadership, NodePolicyStatus, NodeStatusWriter, PolicyRef, PolicyStatusAggregator, PolicySummary,
    read_summary,
};
use wasmplane_test_apiserver::{TestApiServer, Verb};

const POLICIES: usize = 200;
const NODES: usize = 50;
const INTERVAL: Duration = Duration::from_millis(500);

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn seed_policies(server: &TestApiServer) -> Vec<PolicyRef> {
    (0..POLICIES)
        .map(|i| {
            let mut np = NetworkPolicy::default();
            np.metadata.name = Some(format!("policy-{i}"));
            np.metadata.namespace = Some(format!("team-{}", i % 4));
            let stored = server.create(&np).expect("create policy");
            PolicyRef {
                uid: stored.metadata.uid.expect("the server assigns uids"),
                namespace: stored.metadata.namespace.unwrap(),
                name: stored.metadata.name.unwrap(),
            }
        })
        .collect()
}

fn annotation(server: &TestApiServer, policy: &PolicyRef) -> Option<PolicySummary> {
    let np: NetworkPolicy = server.get(&policy.namespace, &policy.name)?;
    let value = np.metadata.annotations?.get(POLICY_STATUS_ANNOTATION)?.clone();
    Some(serde_json::from_str(&value).expect("the annotation is a summary"))
}

async fn wait_converged(
    server: &TestApiServer,
    policies: &[PolicyRef],
    expected: impl Fn(usize) -> PolicySummary,
) -> Duration {
    let start = Instant::now();
    loop {
        let done = policies.iter().enumerate().all(|(i, p)| annotation(server, p) == Some(expected(i)));
        if done {
            return start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(90), "summaries did not converge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn writers(store: &Arc<dyn KvStore>) -> Vec<Arc<NodeStatusWriter>> {
    (0..NODES)
        .map(|n| Arc::new(NodeStatusWriter::new(store.clone(), POLICY_STATUS_PREFIX, format!("node-{n}"))))
        .collect()
}

/// Every node writes a status for each of `policies`, all nodes at once.
async fn report(
    writers: &[Arc<NodeStatusWriter>],
    policies: &[PolicyRef],
    status: impl Fn(usize, usize) -> NodePolicyStatus + Clone + Send + 'static,
) {
    let mut tasks = Vec::new();
    for (n, writer) in writers.iter().enumerate() {
        let (writer, policies, status) = (writer.clone(), policies.to_vec(), status.clone());
        tasks.push(tokio::spawn(async move {
            for (i, p) in policies.iter().enumerate() {
                writer.set(p, status(n, i)).await.expect("status write");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn summary(uid: &str, enforcing: &[(i64, u32)], failing: &[(&str, i64, &str)]) -> PolicySummary {
    PolicySummary {
        uid: uid.into(),
        nodes: enforcing.iter().map(|(_, c)| c).sum::<u32>() + failing.len() as u32,
        enforcing: enforcing.iter().copied().collect::<BTreeMap<_, _>>(),
        failing_count: failing.len() as u32,
        failing: failing
            .iter()
            .map(|(node, generation, error)| wasmplane_operator::policystatus::FailingNode {
                node: node.to_string(),
                generation: *generation,
                error: error.to_string(),
            })
            .collect(),
    }
}

/// Writes allowed by the limits: per policy one right away and then one per
/// interval elapsed.
fn write_bound(policies: usize, elapsed: Duration) -> u64 {
    let intervals = (elapsed.as_millis() / INTERVAL.as_millis()) as u64 + 2;
    policies as u64 * intervals
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_200_policies_on_50_nodes_makes_a_bounded_number_of_writes() {
    init_tracing();
    let server = TestApiServer::start().await;
    let policies = seed_policies(&server);
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config =
        AggregatorConfig { per_policy_interval: INTERVAL, max_writes_per_second: 500, ..AggregatorConfig::default() };
    server.reset_request_counts();
    let aggregator =
        PolicyStatusAggregator::start(store.clone(), server.client(), Leadership::always(), config.clone())
            .await
            .expect("aggregator starts");
    let nodes = writers(&store);

    // Phase 1: every node enforces generation 1 of every policy: 10 000 statuses.
    let start = Instant::now();
    report(&nodes, &policies, |_, _| NodePolicyStatus::ok(1)).await;
    let uids: Vec<String> = policies.iter().map(|p| p.uid.clone()).collect();
    wait_converged(&server, &policies, |i| summary(&uids[i], &[(1, NODES as u32)], &[])).await;
    let elapsed = start.elapsed();
    let patches = server.request_count::<NetworkPolicy>(Verb::Patch);
    tracing::info!(patches, ?elapsed, "phase 1 converged");
    assert!(patches >= POLICIES as u64, "each policy written at least once: {patches}");
    assert!(patches <= write_bound(POLICIES, elapsed), "{patches} writes in {elapsed:?} exceed the per-policy limit");
    assert!(patches < (POLICIES * NODES / 10) as u64, "{patches} writes: not coalesced across nodes");
    assert_eq!(server.request_count::<NetworkPolicy>(Verb::List), 1, "one listing on gaining leadership");

    // Nothing changes: nothing is written.
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(server.request_count::<NetworkPolicy>(Verb::Patch), patches, "unchanged summaries were rewritten");

    // Phase 2: 20 policies move to generation 2 on every node; node-3 fails on policy 0.
    let changed: Vec<PolicyRef> = policies[..20].to_vec();
    let start = Instant::now();
    report(&nodes, &changed, |n, i| {
        if n == 3 && i == 0 { NodePolicyStatus::failed(2, "guest trapped") } else { NodePolicyStatus::ok(2) }
    })
    .await;
    wait_converged(&server, &changed, |i| {
        if i == 0 {
            summary(&uids[0], &[(2, NODES as u32 - 1)], &[("node-3", 2, "guest trapped")])
        } else {
            summary(&uids[i], &[(2, NODES as u32)], &[])
        }
    })
    .await;
    let elapsed = start.elapsed();
    let phase2 = server.request_count::<NetworkPolicy>(Verb::Patch) - patches;
    tracing::info!(phase2, ?elapsed, "phase 2 converged");
    assert!(
        phase2 >= 20 && phase2 <= write_bound(20, elapsed),
        "{phase2} writes for 20 changed policies in {elapsed:?}"
    );

    // The aggregate is available in memory and straight from the kvstore.
    let expected0 = summary(&uids[0], &[(2, NODES as u32 - 1)], &[("node-3", 2, "guest trapped")]);
    assert_eq!(aggregator.summary(&policies[0].namespace, &policies[0].name), Some(expected0.clone()));
    assert_eq!(read_summary(store.as_ref(), POLICY_STATUS_PREFIX, &policies[0]).await.unwrap(), expected0);
    assert_eq!(aggregator.summary("team-0", "no-such-policy"), None);

    // Failover: a new leader with the same kvstore content writes nothing, since
    // the API server already carries every summary.
    drop(aggregator);
    let before = server.request_count::<NetworkPolicy>(Verb::Patch);
    let successor = PolicyStatusAggregator::start(store.clone(), server.client(), Leadership::always(), config)
        .await
        .expect("successor starts");
    tokio::time::sleep(INTERVAL * 4).await;
    assert_eq!(server.request_count::<NetworkPolicy>(Verb::List), 2);
    assert_eq!(server.request_count::<NetworkPolicy>(Verb::Patch), before, "failover rewrote unchanged summaries");

    // A node that stops reporting a policy is dropped from its summary.
    nodes[3].remove(&policies[0]).await.unwrap();
    wait_converged(&server, &policies[..1], |_| summary(&uids[0], &[(2, NODES as u32 - 1)], &[])).await;
    // The server holds the patch before the writer's client has its answer (and counts
    // the write): wait for the count instead of reading it at once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while successor.writes() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(successor.writes() >= 1, "the successor made the write");
}

#[tokio::test]
async fn unchanged_status_is_not_rewritten_by_agents() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let writer = NodeStatusWriter::new(store.clone(), POLICY_STATUS_PREFIX, "node-1");
    let policy = PolicyRef { uid: "u".into(), namespace: "ns".into(), name: "p".into() };
    writer.set(&policy, NodePolicyStatus::ok(1)).await.unwrap();
    let revision = store.current_revision().await.unwrap();
    writer.set(&policy, NodePolicyStatus::ok(1)).await.unwrap();
    assert_eq!(store.current_revision().await.unwrap(), revision, "identical status written again");
    writer.set(&policy, NodePolicyStatus::ok(2)).await.unwrap();
    assert!(store.current_revision().await.unwrap() > revision);
}
