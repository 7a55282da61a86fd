//! The `Authorize` hook over a real tonic server and client on 127.0.0.1: a refusal is the
//! call's answer and the feed never hears of the watch; an accepted caller gets the usual
//! snapshot; the hook sees the caller's address and metadata.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::time::timeout;
use tonic::codegen::http::HeaderMap;
use tonic::{Code, Status};
use wasmplane_grpc::proto::{self, watch_response::Event};
use wasmplane_grpc::{Authorize, LocalModelClient, ModelFeed, Snapshot, WatchService};
use wasmplane_model::state::NodeContext;

const WAIT: Duration = Duration::from_secs(20);

/// Lets in callers whose `authorization` is `Bearer <token>`; refuses the rest with `refusal`.
/// Records what it was shown.
struct Recording {
    token: &'static str,
    refusal: Code,
    seen: Mutex<Vec<(Option<SocketAddr>, Option<String>)>>,
}

impl Recording {
    fn new(token: &'static str, refusal: Code) -> Arc<Recording> {
        Arc::new(Recording { token, refusal, seen: Mutex::new(Vec::new()) })
    }

    fn seen(&self) -> Vec<(Option<SocketAddr>, Option<String>)> {
        self.seen.lock().unwrap().clone()
    }
}

impl Authorize for Recording {
    fn authorize<'a>(&'a self, peer: Option<SocketAddr>, headers: &'a HeaderMap) -> BoxFuture<'a, Result<(), Status>> {
        Box::pin(async move {
            let given = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
            self.seen.lock().unwrap().push((peer, given.clone()));
            // Answer from another task's turn, as a real check (a TokenReview) would.
            tokio::task::yield_now().await;
            if given.as_deref() == Some(&format!("Bearer {}", self.token)) {
                Ok(())
            } else {
                Err(Status::new(self.refusal, "no valid token"))
            }
        })
    }
}

/// A feed over a fixed model at revision 3, and how many snapshots were taken of it.
fn feed() -> (ModelFeed, Arc<AtomicUsize>) {
    let taken = Arc::new(AtomicUsize::new(0));
    let counter = taken.clone();
    let snapshot = Snapshot {
        revision: 3,
        node: NodeContext { node_name: "node-a".into(), ..Default::default() }.into(),
        services: vec![],
    };
    let feed = ModelFeed::new(
        Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            snapshot.clone()
        }),
        16,
    );
    (feed, taken)
}

async fn start(service: WatchService) -> (SocketAddr, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        wasmplane_grpc::serve(service, listener, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    (addr, tx, task)
}

async fn watch(addr: SocketAddr, token: Option<&str>) -> Result<tonic::Streaming<proto::WatchResponse>, Status> {
    let mut client = LocalModelClient::connect(format!("http://{addr}")).await.unwrap();
    let mut request = tonic::Request::new(proto::WatchRequest {});
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    timeout(WAIT, client.watch(request)).await.expect("an answer in time").map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_caller_gets_the_refusal_and_no_snapshot() {
    for code in [Code::Unauthenticated, Code::PermissionDenied, Code::Unavailable] {
        let (feed, taken) = feed();
        let authorize = Recording::new("right-token", code);
        let (addr, stop, task) = start(WatchService::new(feed.clone()).authorize(authorize.clone())).await;

        for token in [None, Some("wrong-token")] {
            let status = watch(addr, token).await.map(|_| ()).expect_err("the watch must be refused");
            assert_eq!(status.code(), code, "{status:?}");
            assert_eq!(status.message(), "no valid token");
        }
        // Nothing of the feed was touched: no watch counted, no subscriber, no snapshot taken.
        let stats = feed.stats();
        assert_eq!((stats.watches, stats.subscribers, stats.snapshots_sent), (0, 0, 0), "{stats:?}");
        assert_eq!(taken.load(Ordering::Relaxed), 0);
        // But both refusals were, under the code they were answered with.
        assert_eq!((stats.refused.get(code), stats.refused.total()), (2, 2), "{stats:?}");
        let seen = authorize.seen();
        assert_eq!(
            seen.iter().map(|(_, token)| token.clone()).collect::<Vec<_>>(),
            vec![None, Some("Bearer wrong-token".to_string())]
        );

        stop.send(()).unwrap();
        timeout(WAIT, task).await.expect("server did not stop").unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_caller_gets_the_snapshot_and_the_hook_sees_its_address() {
    let (feed, taken) = feed();
    let authorize = Recording::new("right-token", Code::Unauthenticated);
    let (addr, stop, task) = start(WatchService::new(feed.clone()).authorize(authorize.clone())).await;

    let mut stream = watch(addr, Some("right-token")).await.expect("the right token is let in");
    let first = timeout(WAIT, stream.message()).await.expect("a message in time").unwrap().expect("the stream is open");
    let Some(Event::Snapshot(snapshot)) = first.event else { panic!("first message is not a snapshot: {first:?}") };
    assert_eq!((snapshot.revision, snapshot.more), (3, false));
    assert_eq!(snapshot.context.unwrap().node_name, "node-a");
    assert_eq!(taken.load(Ordering::Relaxed), 1);

    // The hook saw this client's end of the connection, not the server's.
    let seen = authorize.seen();
    assert_eq!(seen.len(), 1, "one call, one check: {seen:?}");
    let (peer, token) = &seen[0];
    let peer = peer.expect("the peer address reaches the hook");
    assert!(peer.ip().is_loopback() && peer.port() != 0 && peer != addr, "{peer}");
    assert_eq!(token.as_deref(), Some("Bearer right-token"));

    // A second call on its own connection is checked again.
    let status = watch(addr, None).await.map(|_| ()).expect_err("no token, no watch");
    assert_eq!(status.code(), Code::Unauthenticated);
    assert_eq!(authorize.seen().len(), 2);
    assert_eq!(feed.stats().watches, 1);

    drop(stream);
    stop.send(()).unwrap();
    timeout(WAIT, task).await.expect("server did not stop").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_hook_everyone_may_watch() {
    let (feed, _) = feed();
    let (addr, stop, task) = start(WatchService::new(feed.clone())).await;
    let mut stream = watch(addr, None).await.expect("no hook: open");
    let first = timeout(WAIT, stream.message()).await.unwrap().unwrap().unwrap();
    assert!(matches!(first.event, Some(Event::Snapshot(ref s)) if s.revision == 3));
    drop(stream);
    stop.send(()).unwrap();
    timeout(WAIT, task).await.expect("server did not stop").unwrap();
}
