//! The watch stream end to end: a real tonic server on 127.0.0.1, real tonic clients, and the
//! real cluster state and node-local model as the host drives them. Every complete state a
//! client reconstructs is checked against the host's model at the revision the client
//! reports, so a lost, repeated or misapplied delta cannot go unnoticed.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use wasmplane_grpc::proto::{self, watch_response::Event};
use wasmplane_grpc::{
    Applied, Delta, LocalModelClient, Mirror, ModelFeed, ServeError, Snapshot, SnapshotSource, WatchService,
};
use wasmplane_model::state::NodeContext;
use wasmplane_model::*;

const NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(20);

// ---- the host side: cluster state + node-local model + feed, with a history to check against ----

#[derive(Clone, Debug)]
struct Recorded {
    context: NodeContext,
    services: BTreeMap<ObjectKey, Arc<ServiceView>>,
}

struct HostState {
    cluster: ClusterState,
    model: NodeLocalModel,
    history: BTreeMap<u64, Recorded>,
}

struct Host {
    state: Mutex<HostState>,
}

impl SnapshotSource for Host {
    fn snapshot(&self) -> Snapshot {
        Snapshot::of(&self.state.lock().unwrap().model)
    }
}

impl Host {
    fn new() -> Arc<Host> {
        let model = NodeLocalModel::new(NODE, vec!["10.244.0.0/16".into()]);
        let mut history = BTreeMap::new();
        history.insert(0, Recorded { context: model.context.clone(), services: BTreeMap::new() });
        Arc::new(Host { state: Mutex::new(HostState { cluster: ClusterState::new(), model, history }) })
    }

    /// What the host's controller does for every event: update the model and publish the
    /// revision, under the model lock.
    fn apply(&self, feed: &ModelFeed, event: ClusterEvent) -> u64 {
        let mut guard = self.state.lock().unwrap();
        let HostState { cluster, model, history } = &mut *guard;
        let touched = cluster.apply(event, NODE);
        let update = model.update(cluster, &touched);
        if !update.is_empty() {
            history
                .insert(model.revision, Recorded { context: model.context.clone(), services: model.services.clone() });
            feed.publish(Delta::from_update(model, &update));
        }
        model.revision
    }

    fn upsert(&self, feed: &ModelFeed, object: ClusterObject) -> u64 {
        self.apply(feed, ClusterEvent::Upsert(object))
    }

    fn revision(&self) -> u64 {
        self.state.lock().unwrap().model.revision
    }

    fn at(&self, revision: u64) -> Recorded {
        self.state.lock().unwrap().history.get(&revision).cloned().unwrap_or_else(|| panic!("no revision {revision}"))
    }
}

fn feed_for(host: &Arc<Host>, capacity: usize) -> ModelFeed {
    ModelFeed::new(host.clone(), capacity)
}

// ---- cluster objects ----

fn service(name: &str, ip: &str, blob: &str) -> ClusterObject {
    let mut labels = Labels::from([("app".into(), name.into())]);
    if !blob.is_empty() {
        labels.insert("blob".into(), blob.into());
    }
    ClusterObject::Service(Service {
        external_traffic_policy: TrafficPolicy::Local,
        labels,
        ..Service::cluster_ip("default", name, ip, vec![ServicePort::tcp("http", 80, 8080)])
    })
}

fn slice(name: &str, service: &str, endpoints: &[(&str, &str)]) -> ClusterObject {
    ClusterObject::EndpointSlice(EndpointSlice {
        namespace: "default".into(),
        name: name.into(),
        service_name: service.into(),
        endpoints: endpoints
            .iter()
            .map(|&(ip, node)| Endpoint {
                addresses: vec![ip.into()],
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some(node.into()),
                zone: Some("zone-a".into()),
                for_zones: vec![],
                for_nodes: vec![],
            })
            .collect(),
        ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        trigger_time: None,
        cluster: None,
    })
}

fn node(addresses: &[&str], zone: &str) -> ClusterObject {
    ClusterObject::Node(Node {
        name: NODE.into(),
        addresses: addresses.iter().map(|&a| a.into()).collect(),
        pod_cidrs: vec!["10.244.1.0/24".into()],
        labels: Labels::from([(ZONE_LABEL.into(), zone.into())]),
        being_deleted: false,
    })
}

fn local_pod(name: &str, ip: &str) -> ClusterObject {
    ClusterObject::Pod(Pod {
        namespace: "default".into(),
        name: name.into(),
        ips: vec![ip.into()],
        node_name: Some(NODE.into()),
        labels: Labels::new(),
        ports: vec![],
        host_network: false,
    })
}

// ---- server and clients ----

struct Server {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Server {
    async fn start(service: impl Into<WatchService>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let service: WatchService = service.into();
        let task = tokio::spawn(wasmplane_grpc::serve(service, listener, async {
            let _ = rx.await;
        }));
        Server { addr, shutdown: Some(tx), task }
    }

    async fn stop(mut self) {
        self.shutdown.take().unwrap().send(()).unwrap();
        timeout(WAIT, self.task).await.expect("server did not stop").unwrap().unwrap();
    }
}

struct Client {
    name: &'static str,
    stream: tonic::Streaming<proto::WatchResponse>,
    mirror: Mirror,
    /// Every message applied, in order.
    log: Vec<Applied>,
}

impl Client {
    async fn connect(name: &'static str, addr: SocketAddr) -> Client {
        let mut client = LocalModelClient::connect(format!("http://{addr}")).await.unwrap();
        let stream = client.watch(proto::WatchRequest {}).await.unwrap().into_inner();
        Client { name, stream, mirror: Mirror::new(), log: Vec::new() }
    }

    /// The next raw message, or `None` when the stream ended cleanly.
    async fn raw(&mut self) -> Option<proto::WatchResponse> {
        timeout(WAIT, self.stream.message())
            .await
            .unwrap_or_else(|_| panic!("{}: no message in time", self.name))
            .unwrap()
    }

    /// Applies the next message to the mirror and, if the mirror is complete after it, checks
    /// it against the host's model at that revision.
    async fn step(&mut self, host: &Host) -> (proto::WatchResponse, Applied) {
        let raw = self.raw().await.unwrap_or_else(|| panic!("{}: stream ended", self.name));
        let applied = self.mirror.apply(raw.clone()).unwrap_or_else(|e| panic!("{}: {e}", self.name));
        if let Some(revision) = applied.revision() {
            assert_same(&self.mirror, &host.at(revision), self.name);
        }
        self.log.push(applied);
        (raw, applied)
    }

    /// Reads until the mirror is complete at `revision`.
    async fn until(&mut self, host: &Host, revision: u64) {
        while self.mirror.revision() != Some(revision) {
            self.step(host).await;
            if let Some(have) = self.mirror.revision() {
                assert!(have <= revision, "{}: went past {revision} to {have}", self.name);
            }
        }
    }

    /// The next message, applied without checking against a host history.
    async fn read(&mut self) -> proto::WatchResponse {
        let raw = self.raw().await.unwrap_or_else(|| panic!("{}: stream ended", self.name));
        self.mirror.apply(raw.clone()).unwrap_or_else(|e| panic!("{}: {e}", self.name));
        raw
    }

    fn snapshots(&self) -> Vec<u64> {
        self.log
            .iter()
            .filter_map(|a| if let Applied::Snapshot { revision, .. } = a { Some(*revision) } else { None })
            .collect()
    }
}

fn assert_same(mirror: &Mirror, expected: &Recorded, who: &str) {
    let revision = mirror.revision().unwrap();
    assert_eq!(mirror.context(), &expected.context, "{who}: context at revision {revision}");
    let keys: Vec<_> = mirror.services().keys().collect();
    assert_eq!(keys, expected.services.keys().collect::<Vec<_>>(), "{who}: services at revision {revision}");
    for (key, view) in &expected.services {
        assert!(mirror.services()[key] == **view, "{who}: service {key} at revision {revision}");
    }
}

fn delta(raw: &proto::WatchResponse) -> &proto::Delta {
    match &raw.event {
        Some(Event::Delta(d)) => d,
        other => panic!("expected a delta, got {other:?}"),
    }
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    timeout(WAIT, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

// ---- the tests ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_state_first_then_contiguous_deltas() {
    let host = Host::new();
    let feed = feed_for(&host, 64);
    host.upsert(&feed, node(&["192.168.0.1"], "zone-a"));
    host.upsert(&feed, service("web", "10.96.0.10", ""));
    host.upsert(&feed, service("api", "10.96.0.11", ""));
    host.upsert(&feed, service("db", "10.96.0.12", ""));
    let start = host.upsert(&feed, slice("web-1", "web", &[("10.244.1.2", NODE), ("10.244.2.2", "node-b")]));
    let server = Server::start(feed.clone()).await;
    let mut client = Client::connect("client", server.addr).await;

    // The snapshot: the whole model, in one part, checked field by field on the wire too.
    let (raw, applied) = client.step(&host).await;
    assert_eq!(applied, Applied::Snapshot { revision: start, services: 3 });
    let Some(Event::Snapshot(snapshot)) = raw.event else { panic!("first message is not a snapshot") };
    assert_eq!((snapshot.revision, snapshot.part, snapshot.more), (start, 0, false));
    let context = snapshot.context.unwrap();
    assert_eq!((context.node_name.as_str(), context.zone.as_deref()), (NODE, Some("zone-a")));
    assert_eq!(context.node_ips, vec!["192.168.0.1".to_string()]);
    let web = snapshot.services.iter().find(|s| s.service.as_ref().unwrap().name == "web").unwrap();
    let endpoints: Vec<_> = web.slices[0].endpoints.iter().map(|e| (e.addresses[0].as_str(), e.is_local)).collect();
    assert_eq!(endpoints, vec![("10.244.1.2", true), ("10.244.2.2", false)]);
    assert_eq!(web.service.as_ref().unwrap().external_traffic_policy, i32::from(proto::TrafficPolicy::Local));

    // An update: an upsert of the whole view, nothing else.
    let r = host.upsert(&feed, service("api", "10.96.0.99", ""));
    let (raw, _) = client.step(&host).await;
    let d = delta(&raw);
    assert_eq!((d.revision, d.upserts.len(), d.deletes.len(), d.context.is_none()), (r, 1, 0, true));
    assert_eq!(r, start + 1);

    // A delete: by key.
    let r = host.apply(&feed, ClusterEvent::Delete(ObjectKind::Service, ObjectKey::new("default", "db")));
    let (raw, _) = client.step(&host).await;
    let d = delta(&raw);
    assert_eq!((d.revision, d.upserts.len()), (r, 0));
    assert_eq!(
        d.deletes,
        vec![proto::ObjectRef {
            kind: Some(proto::object_ref::Kind::Service(proto::ObjectKey {
                namespace: "default".into(),
                name: "db".into()
            }))
        }]
    );

    // This node's addresses: a context change alone.
    let r = host.upsert(&feed, node(&["192.168.0.1", "fd00::1"], "zone-a"));
    let (raw, _) = client.step(&host).await;
    let d = delta(&raw);
    assert_eq!((d.revision, d.upserts.len(), d.deletes.len()), (r, 0, 0));
    assert_eq!(d.context.as_ref().unwrap().node_ips.len(), 2);

    // A local pod moves the revision without touching services: an empty delta keeps the
    // revisions contiguous.
    let r = host.upsert(&feed, local_pod("web-1", "10.244.1.2"));
    let (raw, _) = client.step(&host).await;
    let d = delta(&raw);
    assert_eq!((d.revision, d.upserts.len(), d.deletes.len(), d.context.is_none()), (r, 0, 0, true));

    // An endpoint moving to this node flips is_local.
    let r = host.upsert(&feed, slice("web-1", "web", &[("10.244.1.2", NODE), ("10.244.2.2", NODE)]));
    let (raw, _) = client.step(&host).await;
    let d = delta(&raw);
    assert_eq!(d.revision, r);
    let Some(proto::object::Kind::Service(web)) = &d.upserts[0].kind else { panic!("not a service") };
    assert!(web.slices[0].endpoints.iter().all(|e| e.is_local));

    assert_eq!(client.mirror.revision(), Some(host.revision()));
    let stats = feed.stats();
    assert_eq!((stats.subscribers, stats.watches, stats.snapshots_sent, stats.deltas_sent), (1, 1, 1, 5));
    assert_eq!((stats.resyncs_lagged, stats.resyncs_gap), (0, 0));

    // A client that goes away releases its subscription.
    drop(client);
    eventually("the watch to end", || feed.subscribers() == 0).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_and_late_joiners_see_no_gap_and_no_repeat() {
    let host = Host::new();
    let feed = feed_for(&host, 256);
    host.upsert(&feed, node(&["192.168.0.1"], "zone-a"));
    for i in 0..5 {
        host.upsert(&feed, service(&format!("svc-{i}"), &format!("10.96.0.{i}"), ""));
    }
    let server = Server::start(feed.clone()).await;
    let mut a = Client::connect("a", server.addr).await;
    a.until(&host, host.revision()).await;

    for i in 0..10 {
        host.upsert(&feed, service(&format!("svc-{}", i % 5), &format!("10.96.1.{i}"), ""));
    }
    // A client joining now gets a snapshot at the current revision, then only later deltas.
    let joined_at = host.revision();
    let mut b = Client::connect("b", server.addr).await;
    b.step(&host).await;
    assert_eq!(b.snapshots(), vec![joined_at]);
    a.until(&host, joined_at).await;

    // Now with the host publishing while a third client joins: wherever its snapshot falls,
    // what follows must continue from it exactly (the mirror refuses gaps and repeats).
    let publisher = {
        let (host, feed) = (host.clone(), feed.clone());
        tokio::spawn(async move {
            for i in 0..200u32 {
                let name = format!("svc-{}", i % 7);
                if i % 11 == 10 {
                    host.apply(&feed, ClusterEvent::Delete(ObjectKind::Service, ObjectKey::new("default", name)));
                } else {
                    host.upsert(&feed, service(&name, &format!("10.96.2.{}", i % 250), ""));
                }
                if i % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut c = Client::connect("c", server.addr).await;
    publisher.await.unwrap();
    let end = host.revision();
    assert_eq!(feed.subscribers(), 3);
    for client in [&mut a, &mut b, &mut c] {
        client.until(&host, end).await;
        assert_eq!(client.snapshots().len(), 1, "{}: only the first message is a snapshot", client.name);
    }
    let stats = feed.stats();
    assert_eq!((stats.snapshots_sent, stats.resyncs_lagged, stats.resyncs_gap), (3, 0, 0));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_falls_behind_gets_a_fresh_snapshot_then_contiguous_deltas() {
    const SERVICES: usize = 10;
    const BLOB: usize = 16 * 1024;
    // 3000 deltas of ~16 KiB: ~48 MiB, far beyond what the HTTP/2 windows and the socket
    // buffers between server and client can hold while the client does not read.
    const REVISIONS: usize = 3000;

    let host = Host::new();
    let feed = feed_for(&host, 8);
    let blob = |i: usize| format!("{i:08}{}", "x".repeat(BLOB));
    for i in 0..SERVICES {
        host.upsert(&feed, service(&format!("svc-{i}"), &format!("10.96.0.{i}"), &blob(i)));
    }
    let server = Server::start(feed.clone()).await;
    let mut client = Client::connect("slow", server.addr).await;
    client.until(&host, host.revision()).await;

    // The client stops reading while the host moves on.
    for i in 0..REVISIONS {
        host.upsert(
            &feed,
            service(&format!("svc-{}", i % SERVICES), &format!("10.96.0.{}", i % SERVICES), &blob(i + SERVICES)),
        );
    }
    let end = host.revision();

    // Reading again: whatever was still buffered (contiguous deltas), then a snapshot at the
    // host's current revision, equal to its state (checked at every step).
    client.until(&host, end).await;
    let snapshots = client.snapshots();
    assert!(snapshots.len() >= 2, "no resync: {snapshots:?}");
    // A resync happens only when a needed delta is gone, so never twice at one revision.
    assert!(snapshots.windows(2).all(|w| w[0] < w[1]), "redundant resyncs: {snapshots:?}");
    assert_eq!(*snapshots.last().unwrap(), end, "the resync is the current state");
    assert_eq!(client.mirror.services().len(), SERVICES);
    let stats = feed.stats();
    assert!(stats.resyncs_lagged >= 1, "{stats:?}");
    assert_eq!(stats.resyncs_gap, 0);
    assert_eq!(stats.snapshots_sent, snapshots.len() as u64);

    // And it carries on with deltas from there, one revision at a time.
    for i in 0..20 {
        let r = host.upsert(&feed, service("svc-0", "10.96.0.0", &format!("after-{i}")));
        let (raw, _) = client.step(&host).await;
        assert_eq!(delta(&raw).revision, r);
    }
    assert_eq!(client.snapshots().len(), snapshots.len());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_snapshots_arrive_in_parts() {
    let host = Host::new();
    let feed = feed_for(&host, 16);
    for i in 0..200 {
        host.upsert(&feed, service(&format!("svc-{i:03}"), &format!("10.96.{}.{}", i / 250, i % 250), ""));
        host.upsert(
            &feed,
            slice(&format!("svc-{i:03}-1"), &format!("svc-{i:03}"), &[("10.244.1.2", NODE), ("10.244.2.2", "node-b")]),
        );
    }
    let server = Server::start(WatchService::new(feed.clone()).snapshot_part_bytes(4096)).await;
    let mut client = Client::connect("parts", server.addr).await;
    let mut parts = 0;
    loop {
        let (raw, applied) = client.step(&host).await;
        let Some(Event::Snapshot(part)) = raw.event else { panic!("a delta inside a snapshot") };
        assert_eq!(part.part, parts);
        assert!(part.services.len() == 1 || prost::Message::encoded_len(&part) <= 4096);
        parts += 1;
        if let Applied::Snapshot { revision, services } = applied {
            assert_eq!((revision, services), (host.revision(), 200));
            break;
        }
    }
    assert!(parts > 5, "{parts} parts");
    let r = host.upsert(&feed, service("svc-000", "10.96.9.9", ""));
    let (raw, _) = client.step(&host).await;
    assert_eq!(delta(&raw).revision, r);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_every_stream_and_the_server() {
    let host = Host::new();
    let feed = feed_for(&host, 16);
    host.upsert(&feed, service("web", "10.96.0.10", ""));
    let server = Server::start(feed.clone()).await;
    let addr = server.addr;
    let mut a = Client::connect("a", addr).await;
    let mut b = Client::connect("b", addr).await;
    a.step(&host).await;
    b.step(&host).await;

    server.stop().await;
    assert!(a.raw().await.is_none(), "a's stream ends cleanly");
    assert!(b.raw().await.is_none(), "b's stream ends cleanly");
    assert_eq!(feed.subscribers(), 0);
    assert!(LocalModelClient::connect(format!("http://{addr}")).await.is_err(), "nothing listens any more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_feed_ends_watches_of_a_hand_built_server() {
    let host = Host::new();
    let feed = feed_for(&host, 16);
    host.upsert(&feed, service("web", "10.96.0.10", ""));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wasmplane_grpc::service(feed.clone()))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), {
                let feed = feed.clone();
                async move {
                    let _ = rx.await;
                    // The documented pattern: end the watches, then let tonic drain.
                    feed.close();
                }
            }),
    );
    let mut client = Client::connect("a", addr).await;
    client.step(&host).await;

    // A closed feed refuses new watches.
    let mut other = LocalModelClient::connect(format!("http://{addr}")).await.unwrap();
    tx.send(()).unwrap();
    assert!(client.raw().await.is_none());
    timeout(WAIT, server).await.expect("server did not stop").unwrap().unwrap();
    assert!(other.watch(proto::WatchRequest {}).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_in_published_revisions_resyncs_instead_of_passing_it_on() {
    // A host bug (a revision never published) must not reach sinks as a silent gap.
    let state = Arc::new(Mutex::new(Snapshot {
        revision: 1,
        node: NodeContext { node_name: NODE.into(), ..Default::default() }.into(),
        services: vec![],
    }));
    let source = state.clone();
    let feed = ModelFeed::new(Arc::new(move || source.lock().unwrap().clone()), 16);
    let server = Server::start(feed.clone()).await;
    let mut client = Client::connect("gap", server.addr).await;
    assert!(matches!(client.read().await.event, Some(Event::Snapshot(ref s)) if s.revision == 1));

    state.lock().unwrap().revision = 2;
    feed.publish(Delta { revision: 2, node: None, changes: vec![] });
    assert_eq!(delta(&client.read().await).revision, 2);

    // Revision 3 is never published.
    state.lock().unwrap().revision = 4;
    feed.publish(Delta { revision: 4, node: None, changes: vec![] });
    assert!(matches!(client.read().await.event, Some(Event::Snapshot(ref s)) if s.revision == 4));
    state.lock().unwrap().revision = 5;
    feed.publish(Delta { revision: 5, node: None, changes: vec![] });
    assert_eq!(delta(&client.read().await).revision, 5);
    let stats = feed.stats();
    assert_eq!((stats.resyncs_gap, stats.resyncs_lagged, stats.snapshots_sent, stats.deltas_sent), (1, 0, 2, 2));
    server.stop().await;
}
