//! The `LocalModel` gRPC service: one [`Watcher`] per `Watch` call, reading the feed.
//!
//! A watch's stream is polled by the HTTP/2 connection only when the client's flow-control
//! window has room, so a client that stops reading stops the watcher too: it stays parked on
//! its broadcast receiver while the ring moves on, and on its next read it learns that it
//! lagged and sends a fresh snapshot. Nothing is buffered per client beyond HTTP/2's own
//! windows, and a slow client never slows the host or the other clients.
//!
//! Who may watch is up to the embedder: an [`Authorize`] hook given to
//! [`WatchService::authorize`] sees each call's peer address and headers first, and its
//! refusal is the call's answer. Without one, every caller may watch.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use futures::future::BoxFuture;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, watch};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::codegen::http::HeaderMap;
use tonic::transport::server::Connected;
use tonic::{Code, Request, Response, Status};

use crate::feed::{Counters, Delta, ModelFeed, Snapshot};
use crate::proto::local_model_server::{LocalModel, LocalModelServer};
use crate::proto::{self, watch_response::Event};

/// Default bound of one snapshot part's encoded size: well under the 4 MiB receive limit
/// most gRPC clients have by default, with room for the message framing.
pub const DEFAULT_SNAPSHOT_PART_BYTES: usize = 1 << 20;

/// Why serving stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC transport failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Decides whether a caller may watch the model. The stream carries every Service, endpoint,
/// pod and policy of the node, so a host reachable from outside should set one.
pub trait Authorize: Send + Sync + 'static {
    /// `Ok` lets the watch start; an `Err` is returned to the caller as it is (typically
    /// `UNAUTHENTICATED`, `PERMISSION_DENIED` or `UNAVAILABLE`). `peer` is the client's
    /// address when the transport knows it (TCP, and TLS over TCP with tonic's connect
    /// info); `headers` are the call's metadata, `authorization` included.
    fn authorize<'a>(&'a self, peer: Option<SocketAddr>, headers: &'a HeaderMap) -> BoxFuture<'a, Result<(), Status>>;
}

/// The service implementation. Build it with [`WatchService::new`] (or `From<ModelFeed>`),
/// tune it, and turn it into a server with [`WatchService::into_server`], or pass it to
/// [`serve`].
#[derive(Clone)]
pub struct WatchService {
    feed: ModelFeed,
    part_bytes: usize,
    /// A stop signal of this service only (set by [`serve`]), besides the feed's own.
    stop: Option<watch::Receiver<bool>>,
    authorize: Option<Arc<dyn Authorize>>,
}

impl std::fmt::Debug for WatchService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchService")
            .field("feed", &self.feed)
            .field("part_bytes", &self.part_bytes)
            .field("stop", &self.stop)
            .field("authorize", &self.authorize.is_some())
            .finish()
    }
}

impl From<ModelFeed> for WatchService {
    fn from(feed: ModelFeed) -> Self {
        WatchService::new(feed)
    }
}

impl WatchService {
    pub fn new(feed: ModelFeed) -> Self {
        WatchService { feed, part_bytes: DEFAULT_SNAPSHOT_PART_BYTES, stop: None, authorize: None }
    }

    /// Every watch must first pass `authorize`; without it, anyone who reaches the server
    /// may watch.
    pub fn authorize(mut self, authorize: Arc<dyn Authorize>) -> Self {
        self.authorize = Some(authorize);
        self
    }

    /// Bound of one snapshot message's encoded size (a part always holds at least one
    /// service, so a single larger service still goes through).
    pub fn snapshot_part_bytes(mut self, bytes: usize) -> Self {
        self.part_bytes = bytes.max(1);
        self
    }

    pub fn into_server(self) -> LocalModelServer<WatchService> {
        // Snapshot parts are bounded by `part_bytes`, but a single service view can be
        // larger; never refuse to send the model because of it.
        LocalModelServer::new(self).max_encoding_message_size(usize::MAX)
    }
}

/// The `LocalModel` service over `feed`, ready for `tonic::transport::Server::add_service`.
/// Its watches end when the client goes away or on [`ModelFeed::close`]; call that before a
/// graceful shutdown of the server, which otherwise waits for them forever.
pub fn service(feed: ModelFeed) -> LocalModelServer<WatchService> {
    WatchService::new(feed).into_server()
}

/// Serves the model on `listener` until `shutdown` resolves, then ends every watch of this
/// server cleanly (clients see their stream finish) and returns once connections are done.
pub async fn serve<F>(
    service: impl Into<WatchService> + Send,
    listener: TcpListener,
    shutdown: F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send,
{
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving the node-local model over gRPC");
    }
    serve_incoming(service, TcpListenerStream::new(listener), shutdown).await
}

/// [`serve`] over any stream of connections (a Unix socket for node-local sinks, say).
pub async fn serve_incoming<I, IO, IE, F>(
    service: impl Into<WatchService> + Send,
    incoming: I,
    shutdown: F,
) -> Result<(), ServeError>
where
    I: Stream<Item = Result<IO, IE>> + Send,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Future<Output = ()> + Send,
{
    let mut service = service.into();
    let (stop_tx, stop_rx) = watch::channel(false);
    service.stop = Some(stop_rx);
    let signal = async move {
        shutdown.await;
        tracing::info!("gRPC model server shutting down; ending watches");
        // Tonic's graceful shutdown waits for every open stream; watches never end on their
        // own, so end them first.
        stop_tx.send_replace(true);
    };
    tonic::transport::Server::builder()
        // Finds clients that vanished without closing (a node reboot, a partition), so their
        // watches are dropped instead of holding a receiver forever.
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, signal)
        .await?;
    tracing::info!("gRPC model server stopped");
    Ok(())
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<proto::WatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl LocalModel for WatchService {
    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<proto::WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let peer = request.remote_addr();
        // First: a caller that may not watch learns nothing, not even that we are stopping.
        if let Some(authorize) = &self.authorize {
            let headers = request.metadata().clone().into_headers();
            if let Err(status) = authorize.authorize(peer, &headers).await {
                tracing::debug!(peer = ?peer, code = ?status.code(), "model watch refused: {}", status.message());
                self.feed.inner.counters.refused(status.code());
                return Err(status);
            }
        }
        if self.feed.is_closed() || self.stop.as_ref().is_some_and(|s| *s.borrow()) {
            self.feed.inner.counters.refused(Code::Unavailable);
            return Err(Status::unavailable("the model server is shutting down"));
        }
        Counters::bump(&self.feed.inner.counters.watches);
        tracing::info!(peer = ?peer, "model watch started");
        let watcher = Watcher {
            // Subscribing before the first snapshot is what makes "snapshot, then every delta
            // after it" hold: any revision newer than the snapshot is published after this.
            deltas: self.feed.inner.deltas.subscribe(),
            feed_closed: self.feed.inner.closed.subscribe(),
            stop: self.stop.clone(),
            feed: self.feed.clone(),
            part_bytes: self.part_bytes,
            revision: 0,
            needs_snapshot: true,
            lagged: false,
            pending: VecDeque::new(),
            peer,
        };
        let stream = futures::stream::unfold(watcher, |mut w| async move { w.next().await.map(|item| (item, w)) });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The state of one watch.
struct Watcher {
    feed: ModelFeed,
    deltas: broadcast::Receiver<Arc<Delta>>,
    feed_closed: watch::Receiver<bool>,
    stop: Option<watch::Receiver<bool>>,
    part_bytes: usize,
    /// The revision the client has (or will have once `pending` is sent).
    revision: u64,
    needs_snapshot: bool,
    /// The ring dropped deltas since the last one this watch read in order: a gap now means
    /// the client read too slowly, not that the host skipped a revision.
    lagged: bool,
    /// Snapshot parts not sent yet.
    pending: VecDeque<proto::Snapshot>,
    peer: Option<SocketAddr>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        tracing::info!(peer = ?self.peer, revision = self.revision, "model watch ended");
    }
}

/// Resolves when `rx` reads true; never if its sender is gone (then nobody can stop us).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn stopped_opt(rx: &mut Option<watch::Receiver<bool>>) {
    match rx {
        Some(rx) => stopped(rx).await,
        None => std::future::pending().await,
    }
}

impl Watcher {
    fn resync(&mut self) {
        self.needs_snapshot = true;
        self.lagged = false;
    }

    fn stop_requested(&self) -> bool {
        *self.feed_closed.borrow() || self.stop.as_ref().is_some_and(|s| *s.borrow())
    }

    /// The next message for the client, or `None` to end the stream.
    async fn next(&mut self) -> Option<Result<proto::WatchResponse, Status>> {
        loop {
            // Checked before every message, so a shutdown does not wait for the rest of a
            // large snapshot to drain to a slow client.
            if self.stop_requested() {
                return None;
            }
            if let Some(part) = self.pending.pop_front() {
                if !part.more {
                    Counters::bump(&self.feed.inner.counters.snapshots_sent);
                }
                return Some(Ok(proto::WatchResponse { event: Some(Event::Snapshot(part)) }));
            }
            if self.needs_snapshot {
                let taken = tokio::select! {
                    _ = stopped(&mut self.feed_closed) => return None,
                    _ = stopped_opt(&mut self.stop) => return None,
                    taken = take_snapshot(&self.feed, self.part_bytes) => taken,
                };
                match taken {
                    Ok((revision, parts)) => {
                        tracing::debug!(peer = ?self.peer, revision, parts = parts.len(), "sending model snapshot");
                        self.revision = revision;
                        self.pending = parts;
                        self.needs_snapshot = false;
                        continue;
                    }
                    Err(status) => return Some(Err(status)),
                }
            }
            let received = tokio::select! {
                _ = stopped(&mut self.feed_closed) => return None,
                _ = stopped_opt(&mut self.stop) => return None,
                received = self.deltas.recv() => received,
            };
            match received {
                // Already in the snapshot the client has.
                Ok(delta) if delta.revision <= self.revision => continue,
                Ok(delta) if delta.revision == self.revision + 1 => {
                    self.revision = delta.revision;
                    self.lagged = false;
                    Counters::bump(&self.feed.inner.counters.deltas_sent);
                    return Some(Ok(proto::WatchResponse { event: Some(Event::Delta(delta_to_proto(&delta))) }));
                }
                Ok(delta) if self.lagged => {
                    tracing::info!(peer = ?self.peer, have = self.revision, next = delta.revision, "model watch fell behind; resyncing with a snapshot");
                    Counters::bump(&self.feed.inner.counters.resyncs_lagged);
                    self.resync();
                }
                Ok(delta) => {
                    tracing::warn!(peer = ?self.peer, have = self.revision, got = delta.revision, "gap in published revisions; resyncing the watch");
                    Counters::bump(&self.feed.inner.counters.resyncs_gap);
                    self.resync();
                }
                // The ring dropped deltas this watch had not read. They may all be older than
                // the snapshot the client has (a watch that just resynced usually still sits
                // behind in the ring), so this alone is no reason for another full transfer:
                // the oldest delta still retained, read next, tells whether one it needs is
                // gone (then it does not follow `revision`, and the arm above resyncs).
                Err(RecvError::Lagged(missed)) => {
                    tracing::debug!(peer = ?self.peer, have = self.revision, missed, "model watch skipped deltas dropped from the ring");
                    self.lagged = true;
                }
                // The feed is gone with its sender: nothing more will come.
                Err(RecvError::Closed) => return None,
            }
        }
    }
}

/// Takes a snapshot from the host and encodes it into parts, on a blocking thread: the host's
/// lock may be a blocking one, and converting tens of thousands of services is CPU work that
/// must not stall the async workers serving the other watches.
async fn take_snapshot(feed: &ModelFeed, part_bytes: usize) -> Result<(u64, VecDeque<proto::Snapshot>), Status> {
    let source = feed.inner.source.clone();
    tokio::task::spawn_blocking(move || {
        let snapshot = source.snapshot();
        (snapshot.revision, split_snapshot(&snapshot, part_bytes))
    })
    .await
    .map_err(|e| {
        tracing::error!(error = %e, "taking a model snapshot failed");
        Status::internal("taking a model snapshot failed")
    })
}

/// The snapshot as consecutive parts of at most about `part_bytes` encoded bytes each.
pub(crate) fn split_snapshot(snapshot: &Snapshot, part_bytes: usize) -> VecDeque<proto::Snapshot> {
    let new_part = |part: u32| proto::Snapshot {
        revision: snapshot.revision,
        context: None,
        services: Vec::new(),
        part,
        more: true,
    };
    let mut first = new_part(0);
    first.context = Some((&snapshot.node).into());
    let mut size = first.encoded_len();
    let mut parts = VecDeque::new();
    let mut current = first;
    for view in &snapshot.services {
        let view = proto::ServiceView::from(view);
        // Field tag, length prefix and body of one repeated message.
        let len = view.encoded_len();
        let cost = 1 + prost::length_delimiter_len(len) + len;
        if !current.services.is_empty() && size + cost > part_bytes {
            let next = new_part(current.part + 1);
            size = next.encoded_len();
            parts.push_back(std::mem::replace(&mut current, next));
        }
        size += cost;
        current.services.push(view);
    }
    current.more = false;
    parts.push_back(current);
    parts
}

pub(crate) fn delta_to_proto(delta: &Delta) -> proto::Delta {
    let mut upserts = Vec::new();
    let mut deletes = Vec::new();
    for change in &delta.changes {
        match &change.view {
            Some(view) => upserts.push(proto::Object { kind: Some(proto::object::Kind::Service(view.into())) }),
            None => {
                deletes.push(proto::ObjectRef { kind: Some(proto::object_ref::Kind::Service((&change.key).into())) })
            }
        }
    }
    proto::Delta { revision: delta.revision, context: delta.node.as_ref().map(Into::into), upserts, deletes }
}

#[cfg(test)]
mod tests {
    use wasmplane_model::ServiceView;
    use wasmplane_model::state::NodeContext;

    use super::*;
    use crate::feed::NodeFacts;

    fn view(name: &str, label_bytes: usize) -> Arc<ServiceView> {
        let mut v = crate::convert::tests_support::sample_view();
        std::sync::Arc::make_mut(&mut v.service).name = name.into();
        std::sync::Arc::make_mut(&mut v.service).labels.insert("blob".into(), "x".repeat(label_bytes).into());
        Arc::new(v)
    }

    /// Refuses every caller with `code`.
    struct Refuse(Code);

    impl Authorize for Refuse {
        fn authorize<'a>(
            &'a self,
            _peer: Option<SocketAddr>,
            _headers: &'a HeaderMap,
        ) -> BoxFuture<'a, Result<(), Status>> {
            Box::pin(async move { Err(Status::new(self.0, "refused")) })
        }
    }

    async fn call(service: &WatchService) -> Result<(), Code> {
        service.watch(Request::new(proto::WatchRequest {})).await.map(drop).map_err(|status| status.code())
    }

    #[tokio::test]
    async fn refused_watches_are_counted_by_code() {
        let feed =
            ModelFeed::new(Arc::new(|| Snapshot { revision: 0, node: NodeFacts::default(), services: vec![] }), 4);
        let unauthenticated = WatchService::new(feed.clone()).authorize(Arc::new(Refuse(Code::Unauthenticated)));
        let forbidden = WatchService::new(feed.clone()).authorize(Arc::new(Refuse(Code::PermissionDenied)));
        let open = WatchService::new(feed.clone());
        for _ in 0..2 {
            assert_eq!(call(&unauthenticated).await, Err(Code::Unauthenticated));
        }
        assert_eq!(call(&forbidden).await, Err(Code::PermissionDenied));
        assert_eq!(call(&open).await, Ok(()), "an open service lets the watch start");

        let stats = feed.stats();
        assert_eq!(stats.watches, 1, "{stats:?}");
        assert_eq!(
            (
                stats.refused.get(Code::Unauthenticated),
                stats.refused.get(Code::PermissionDenied),
                stats.refused.get(Code::Unavailable)
            ),
            (2, 1, 0)
        );
        assert_eq!(stats.refused.total(), 3);
        assert_eq!(
            stats.refused.iter().collect::<Vec<_>>(),
            vec![(Code::PermissionDenied, 1), (Code::Unauthenticated, 2)]
        );
        assert_eq!(format!("{:?}", stats.refused), "{PermissionDenied: 1, Unauthenticated: 2}");

        // A closed feed refuses with `Unavailable`, but the hook answers first: a caller it
        // refuses learns nothing of the shutdown, and is counted under the hook's code.
        feed.close();
        assert_eq!(call(&open).await, Err(Code::Unavailable));
        assert_eq!(call(&unauthenticated).await, Err(Code::Unauthenticated));
        let stats = feed.stats();
        assert_eq!(
            (stats.refused.get(Code::Unavailable), stats.refused.get(Code::Unauthenticated), stats.watches),
            (1, 3, 1),
            "{stats:?}"
        );
    }

    #[test]
    fn small_snapshots_are_one_part() {
        let snapshot = Snapshot {
            revision: 7,
            node: NodeContext { node_name: "n".into(), ..Default::default() }.into(),
            services: vec![view("a", 10)],
        };
        let parts = split_snapshot(&snapshot, DEFAULT_SNAPSHOT_PART_BYTES);
        assert_eq!(parts.len(), 1);
        assert_eq!((parts[0].part, parts[0].more, parts[0].revision), (0, false, 7));
        assert_eq!(parts[0].context.as_ref().unwrap().node_name, "n");

        let empty = Snapshot { revision: 0, node: NodeFacts::default(), services: vec![] };
        let parts = split_snapshot(&empty, 1);
        assert_eq!(parts.len(), 1);
        assert!(!parts[0].more && parts[0].context.is_some());
    }

    #[test]
    fn large_snapshots_are_split_within_the_bound() {
        let services: Vec<_> = (0..50).map(|i| view(&format!("svc-{i:02}"), 1000)).collect();
        let snapshot = Snapshot { revision: 3, node: NodeFacts::default(), services };
        let parts = split_snapshot(&snapshot, 8 * 1024);
        assert!(parts.len() > 5, "{} parts", parts.len());
        for (i, part) in parts.iter().enumerate() {
            assert_eq!(part.part as usize, i);
            assert_eq!(part.more, i + 1 < parts.len());
            assert_eq!(part.context.is_some(), i == 0);
            assert!(!part.services.is_empty());
            assert!(part.encoded_len() <= 8 * 1024, "part {i} is {} bytes", part.encoded_len());
        }
        let names: Vec<_> =
            parts.iter().flat_map(|p| &p.services).map(|s| s.service.as_ref().unwrap().name.clone()).collect();
        assert_eq!(names, (0..50).map(|i| format!("svc-{i:02}")).collect::<Vec<_>>());

        // A service larger than the bound still goes, alone in its part.
        let big = Snapshot {
            revision: 1,
            node: NodeFacts::default(),
            services: vec![view("a", 10), view("b", 20_000), view("c", 10)],
        };
        let parts = split_snapshot(&big, 8 * 1024);
        assert_eq!(parts.iter().map(|p| p.services.len()).collect::<Vec<_>>(), vec![1, 1, 1]);
    }
}
