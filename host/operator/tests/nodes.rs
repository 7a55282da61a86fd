//! The node registry against real etcd (Debian's etcd 3.4 through the test
//! harness) and the embedded store: concurrent ID allocation without
//! duplicates, IDs kept across restarts, first free ID reused, node info
//! vanishing with its lease.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use tokio::time::Instant;
use wasmplane_kvstore::{EmbeddedStore, EtcdConfig, EtcdStore, KvStore};
use wasmplane_operator::nodes::{NODE_IDS_PREFIX, NODE_INFO_PREFIX};
use wasmplane_operator::{NodeRegistry, NodeRegistryConfig, release_node_id};
use wasmplane_test_etcd::Etcd;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn config() -> NodeRegistryConfig {
    NodeRegistryConfig { lease_ttl: Duration::from_secs(2), ..NodeRegistryConfig::default() }
}

fn node_ip(i: u32) -> IpAddr {
    format!("192.168.77.{i}").parse().unwrap()
}

fn pod_cidr(i: u32) -> IpNet {
    format!("10.244.{i}.0/24").parse().unwrap()
}

async fn join(store: Arc<dyn KvStore>, i: u32) -> NodeRegistry {
    NodeRegistry::join(store, config(), &format!("node-{i}"), vec![node_ip(i)], vec![pod_cidr(i)])
        .await
        .unwrap_or_else(|e| panic!("node-{i} joins: {e}"))
}

/// Stores for the agents: one connection each where the backend has
/// connections, as separate processes would have.
type StoreFactory = Box<dyn Fn() -> futures::future::BoxFuture<'static, Arc<dyn KvStore>>>;

async fn registry_scenario(new_store: StoreFactory) {
    // 20 agents register at once.
    let mut joins = Vec::new();
    for i in 1..=20u32 {
        let store = new_store().await;
        joins.push(tokio::spawn(async move { join(store, i).await }));
    }
    let mut agents = Vec::new();
    for j in joins {
        agents.push(j.await.expect("join task"));
    }
    let ids: BTreeSet<u32> = agents.iter().map(|a| a.node_id()).collect();
    assert_eq!(ids, (1..=20).collect::<BTreeSet<_>>(), "IDs 1..20, no duplicate");

    // The store says the same: one key per ID, holding its owner's name.
    let observer = new_store().await;
    let listing = observer.list_prefix(NODE_IDS_PREFIX).await.unwrap();
    assert_eq!(listing.items.len(), 20);
    for agent in &agents {
        let kv = observer.get(&format!("{NODE_IDS_PREFIX}{}", agent.node_id())).await.unwrap().unwrap();
        assert_eq!(kv.value.as_ref(), agent.name().as_bytes());
    }

    // Every agent sees every node's info, with its ID.
    // Deadlines here are generous: 20 watches over one etcd on a loaded 2-core machine.
    let deadline = Instant::now() + Duration::from_secs(15);
    while agents.iter().any(|a| a.nodes().len() < 20) {
        assert!(Instant::now() < deadline, "node info did not reach every agent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = agents[0].nodes();
    let seventh = &seen["node-7"];
    assert_eq!(seventh.id, agents.iter().find(|a| a.name() == "node-7").unwrap().node_id());
    assert_eq!(seventh.node_ips, vec![node_ip(7)]);
    assert_eq!(seventh.pod_cidrs, vec![pod_cidr(7)]);

    // A restarted agent (crash: no leave) keeps its ID.
    let index = agents.iter().position(|a| a.name() == "node-7").unwrap();
    let old = agents.remove(index);
    let old_id = old.node_id();
    drop(old);
    let restarted = join(new_store().await, 7).await;
    assert_eq!(restarted.node_id(), old_id, "restart keeps the node ID");
    agents.push(restarted);

    // A new node gets the next free ID; after an ID is freed, that one is reused.
    let newcomer = join(new_store().await, 21).await;
    assert_eq!(newcomer.node_id(), 21);
    let index = agents.iter().position(|a| a.node_id() == 3).unwrap();
    let third = agents.remove(index);
    let third_name = third.name().to_owned();
    third.leave().await.unwrap();
    assert!(release_node_id(observer.as_ref(), NODE_IDS_PREFIX, &third_name, 3).await.unwrap());
    let late = join(new_store().await, 22).await;
    assert_eq!(late.node_id(), 3, "the first free ID is reused");

    // A node whose lease expires disappears from the info prefix. (IDs were
    // handed out in race order, so the node that left above is any of them.)
    let index = agents.iter().position(|a| a.name() != "node-7").unwrap();
    let crashing = agents.remove(index);
    let crashing_name = crashing.name().to_owned();
    let key = format!("{NODE_INFO_PREFIX}{crashing_name}");
    assert!(observer.get(&key).await.unwrap().is_some());
    drop(crashing);
    let crashed = Instant::now();
    loop {
        if observer.get(&key).await.unwrap().is_none() {
            break;
        }
        assert!(crashed.elapsed() < Duration::from_secs(20), "{crashing_name}'s info outlived its lease");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ... and from the other agents' views.
    let deadline = Instant::now() + Duration::from_secs(10);
    while agents[0].nodes().contains_key(&crashing_name) {
        assert!(Instant::now() < deadline, "{crashing_name} still in another agent's view");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its ID stays reserved for it.
    let ids_after = observer.list_prefix(NODE_IDS_PREFIX).await.unwrap();
    assert!(
        ids_after.items.iter().any(|kv| kv.value.as_ref() == crashing_name.as_bytes()),
        "{crashing_name} keeps its ID"
    );
    drop(late);
    drop(newcomer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_on_real_etcd() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let endpoint = etcd.endpoint();
    let factory: StoreFactory = Box::new(move || {
        let endpoint = endpoint.clone();
        Box::pin(async move {
            let store = EtcdStore::connect(EtcdConfig::new([endpoint])).await.expect("connect to etcd");
            Arc::new(store) as Arc<dyn KvStore>
        })
    });
    registry_scenario(factory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_on_the_embedded_store() {
    init_tracing();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let factory: StoreFactory = Box::new(move || {
        let store = store.clone();
        Box::pin(async move { store })
    });
    registry_scenario(factory).await;
}

#[tokio::test]
async fn leaving_removes_the_info_at_once_and_update_republishes() {
    init_tracing();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let a = join(store.clone(), 1).await;
    let b = join(store.clone(), 2).await;
    a.update(vec![node_ip(101)], vec![pod_cidr(101)]).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.nodes().get("node-1").map(|n| n.node_ips.clone()) != Some(vec![node_ip(101)]) {
        assert!(Instant::now() < deadline, "update not seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.leave().await.unwrap();
    assert!(store.get(&format!("{NODE_INFO_PREFIX}node-1")).await.unwrap().is_none());
}
