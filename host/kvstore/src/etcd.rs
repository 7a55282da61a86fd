//! etcd backend (etcd v3 API through `etcd-client`).
//!
//! Reconnection: `etcd-client` sits on a tonic channel that re-dials on its own,
//! so unary calls only need a deadline (a call on a channel whose server is down
//! would otherwise wait for it) and map failures to [`KvError::Unavailable`].
//! Watches are long-lived gRPC streams that die with the connection; each watch
//! therefore runs in its own task that re-creates the server-side watch from the
//! first revision it has not delivered, and relists on compaction (see
//! [`crate::view`]).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    CompactionOptions, Compare, CompareOp, DeleteOptions, GetOptions, KvClient, LeaseClient, PutOptions, Txn, TxnOp,
    TxnOpResponse, TxnResponse, WatchClient, WatchOptions,
};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info, warn};

use crate::view::WatchView;
use crate::{
    Backoff, Bytes, Created, Deleted, KeyValue, KvError, KvStore, Lease, LeaseId, Listing, Result, Revision,
    WatchEvent, WatchStream, prefix_end,
};

/// Largest gRPC response we accept. etcd-client's default (4 MiB) is too small
/// for a page of chunked blobs or a watch response replaying one.
const MAX_DECODING_MESSAGE_SIZE: usize = 256 * 1024 * 1024;

/// How to reach etcd and how patient to be with it.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Deadline for every unary request (and for opening a watch stream).
    pub request_timeout: Duration,
    /// Deadline for establishing a TCP connection.
    pub connect_timeout: Duration,
    /// HTTP/2 keep-alive ping interval; detects dead connections that never
    /// close (network partitions). etcd refuses pings more often than every 5 s.
    pub keep_alive_interval: Duration,
    /// How long a keep-alive ping may go unanswered.
    pub keep_alive_timeout: Duration,
    /// First delay before re-creating a broken watch; doubles up to `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Events buffered per watch before the watch task waits for its consumer.
    pub watch_buffer: usize,
    /// Keys per page when listing (halved automatically if a page is too big).
    pub list_page_size: i64,
    /// TLS for `https://` endpoints (required for them, refused for `http://` ones).
    pub tls: Option<crate::EtcdTls>,
    /// How often TLS settings loaded from files are read again (rotated certificates).
    pub tls_reload_interval: Duration,
    /// An etcd user to authenticate as (etcd `--auth`); none: anonymous, or the client
    /// certificate's common name when etcd maps it to a user.
    pub user: Option<crate::EtcdUser>,
}

impl EtcdConfig {
    /// Defaults suited to a LAN cluster.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            retry_min: Duration::from_millis(50),
            retry_max: Duration::from_secs(2),
            watch_buffer: 1024,
            list_page_size: 512,
            tls: None,
            tls_reload_interval: Duration::from_secs(30),
            user: None,
        }
    }

    /// Whether a client made with `other` would connect as one made with this: the same
    /// endpoints, user and TLS material (what a changed configuration needs a new connection
    /// for; timeouts aside).
    pub fn same_connection(&self, other: &EtcdConfig) -> bool {
        let same_tls = match (&self.tls, &other.tls) {
            (Some(a), Some(b)) => a.same_material(b),
            (None, None) => true,
            _ => false,
        };
        self.endpoints == other.endpoints && self.user == other.user && same_tls
    }

    pub fn with_user(mut self, user: Option<crate::EtcdUser>) -> Self {
        self.user = user;
        self
    }

    pub fn with_tls(mut self, tls: Option<crate::EtcdTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Every endpoint `https://` with TLS settings, or `http://` without: etcd-client would
    /// otherwise fail on the first request (no CA to check the server with) or refuse the
    /// mix with a message that does not say which setting is missing. [`EtcdStore::connect`]
    /// checks it too; callers that connect later (and retry) check it at start.
    pub fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(KvError::InvalidArgument("no etcd endpoints".into()));
        }
        for endpoint in &self.endpoints {
            match (endpoint.starts_with("https://"), &self.tls) {
                (true, None) => {
                    return Err(KvError::InvalidArgument(format!(
                        "etcd endpoint {endpoint} is https:// but no trusted CA is configured (--etcd-trusted-ca-file or trusted-ca-file)"
                    )));
                }
                (false, Some(_)) => {
                    return Err(KvError::InvalidArgument(format!(
                        "etcd TLS is configured but endpoint {endpoint} is not https://"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// [`KvStore`] on an etcd cluster. Cheap to clone.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Replaced whole when the TLS files change (a rotated client certificate): requests
    /// and watches opened after that use the new connection; those in flight finish on the
    /// old one, whose certificate is still valid then.
    clients: std::sync::RwLock<Arc<Clients>>,
    config: EtcdConfig,
}

struct Clients {
    client: etcd_client::Client,
    kv: KvClient,
    watch: WatchClient,
    lease: LeaseClient,
}

impl Clients {
    async fn connect(config: &EtcdConfig, tls: Option<&crate::EtcdTls>) -> Result<Clients> {
        let mut options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(config.keep_alive_interval, config.keep_alive_timeout)
            // Without a leader a member serves stale reads and silent watches;
            // this makes it fail them so we retry elsewhere or later.
            .with_require_leader(true);
        if let Some(tls) = tls {
            options = options.with_tls(tls.options());
        }
        if let Some(user) = &config.user {
            // etcd-client takes a token at connect (so this needs etcd up) and renews it
            // when etcd says it is stale.
            options = options.with_user(&user.name, &user.password);
        }
        let client = etcd_client::Client::connect(&config.endpoints, Some(options)).await.map_err(map_err)?;
        let kv = client.kv_client().max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE);
        let watch = client.watch_client().max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE);
        let lease = client.lease_client();
        Ok(Clients { client, kv, watch, lease })
    }
}

impl EtcdStore {
    /// Creates the client. Connections are made lazily, so this succeeds while
    /// etcd is down; requests then fail with [`KvError::Unavailable`] until it is up.
    /// TLS settings read from files are read again every `tls_reload_interval` and, when
    /// they changed, used for every connection after that.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        config.validate()?;
        let clients = Clients::connect(&config, config.tls.as_ref()).await?;
        debug!(endpoints = ?config.endpoints, tls = ?config.tls, user = ?config.user, "etcd client created");
        let inner = Arc::new(Inner { clients: std::sync::RwLock::new(Arc::new(clients)), config });
        if let Some(tls) = &inner.config.tls
            && tls.files.is_some()
        {
            tokio::spawn(reload_tls(Arc::downgrade(&inner), tls.clone()));
        }
        Ok(EtcdStore { inner })
    }

    /// The underlying `etcd-client` client, for what this interface does not
    /// cover (and for benchmarks comparing against it).
    pub fn client(&self) -> etcd_client::Client {
        self.inner.clients().client.clone()
    }
}

/// Reads the TLS files again now and then; a change connects anew with them. Ends with
/// the store. A file that cannot be read or holds no certificate (a Secret being
/// updated) keeps the connection as it is.
async fn reload_tls(inner: std::sync::Weak<Inner>, mut current: crate::EtcdTls) {
    let Some(files) = current.files.clone() else { return };
    let interval = match inner.upgrade() {
        Some(inner) => inner.config.tls_reload_interval,
        None => return,
    };
    loop {
        tokio::time::sleep(interval).await;
        let Some(inner) = inner.upgrade() else { return };
        let fresh = match files.load() {
            Ok(fresh) => fresh,
            Err(e) => {
                warn!("etcd TLS files not reloaded (the connection keeps the ones it has): {e}");
                continue;
            }
        };
        if fresh.same_material(&current) {
            continue;
        }
        match Clients::connect(&inner.config, Some(&fresh)).await {
            Ok(clients) => {
                *inner.clients.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(clients);
                info!(endpoints = ?inner.config.endpoints, "etcd TLS files changed: new connections use them");
                current = fresh;
            }
            Err(e) => warn!("etcd TLS files changed but cannot be used; keeping the connection: {e}"),
        }
    }
}

impl Inner {
    fn clients(&self) -> Arc<Clients> {
        self.clients.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Runs one request under the request deadline.
    async fn call<T>(
        &self,
        what: &'static str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RawError> {
        match tokio::time::timeout(self.config.request_timeout, fut).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(RawError::Etcd(e)),
            Err(_) => Err(RawError::Timeout(what, self.config.request_timeout)),
        }
    }

    /// Lists `[prefix, prefix_end)` page by page at one revision (the first
    /// page's, or `revision` when given).
    async fn range(&self, prefix: &str, revision: Option<Revision>, keys_only: bool) -> Result<Listing> {
        let end = prefix_end(prefix.as_bytes());
        let mut start = prefix.as_bytes().to_vec();
        let mut at = revision.unwrap_or(0);
        let mut limit = self.config.list_page_size.max(1);
        let mut items = Vec::new();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if at > 0 {
                options = options.with_revision(at);
            }
            if keys_only {
                options = options.with_keys_only();
            }
            let mut kv = self.clients().kv.clone();
            let mut resp = match self.call("list", kv.get(start.clone(), Some(options))).await {
                Ok(resp) => resp,
                Err(e) if e.is_response_too_large() && limit > 1 => {
                    limit /= 2;
                    debug!(prefix, limit, "list page too large; halving the page size");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if at == 0 {
                at = resp.header().map(|h| h.revision()).unwrap_or(0);
            }
            let more = resp.more();
            let kvs = resp.take_kvs();
            let next_start = kvs.last().map(|kv| {
                let mut key = kv.key().to_vec();
                key.push(0);
                key
            });
            items.extend(kvs.into_iter().map(convert_kv));
            match (more, next_start) {
                (true, Some(next)) => start = next,
                _ => break,
            }
        }
        Ok(Listing { items, revision: at })
    }

    /// etcd's range errors do not say how far history is compacted, but a watch
    /// from revision 1 is cancelled with exactly that number.
    async fn probe_compact_revision(&self) -> Revision {
        let probe = async {
            let mut client = self.clients().watch.clone();
            let mut stream = client.watch(vec![0u8], Some(WatchOptions::new().with_start_revision(1))).await.ok()?;
            while let Ok(Some(resp)) = stream.message().await {
                if resp.compact_revision() > 0 {
                    return Some(resp.compact_revision());
                }
                if resp.canceled() {
                    return None;
                }
            }
            None
        };
        tokio::time::timeout(self.config.request_timeout, probe).await.ok().flatten().unwrap_or(0)
    }

    async fn txn(&self, what: &'static str, txn: Txn) -> Result<TxnResponse, RawError> {
        let mut kv = self.clients().kv.clone();
        self.call(what, kv.txn(txn)).await
    }
}

#[async_trait::async_trait]
impl KvStore for EtcdStore {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let mut kv = self.inner.clients().kv.clone();
        let mut resp = self.inner.call("get", kv.get(key, None)).await?;
        Ok(resp.take_kvs().into_iter().next().map(convert_kv))
    }

    async fn put(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Revision> {
        let size = key.len() + value.len();
        let mut options = PutOptions::new();
        if let Some(lease) = lease {
            options = options.with_lease(lease);
        }
        let mut kv = self.inner.clients().kv.clone();
        let resp = self
            .inner
            .call("put", kv.put(key, Vec::from(value), Some(options)))
            .await
            .map_err(|e| KvError::from(e).with_size(size).with_lease(lease))?;
        Ok(header_revision(resp.header()))
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let mut kv = self.inner.clients().kv.clone();
        let resp = self.inner.call("delete", kv.delete(key, None)).await?;
        Ok(Deleted { count: resp.deleted().max(0) as u64, revision: header_revision(resp.header()) })
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<Deleted> {
        let mut kv = self.inner.clients().kv.clone();
        let options = DeleteOptions::new().with_range(prefix_end(prefix.as_bytes()));
        let resp = self.inner.call("delete prefix", kv.delete(prefix, Some(options))).await?;
        Ok(Deleted { count: resp.deleted().max(0) as u64, revision: header_revision(resp.header()) })
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Listing> {
        self.inner.range(prefix, None, false).await
    }

    async fn watch_prefix(&self, prefix: &str, from: Option<Revision>) -> Result<WatchStream> {
        // Seed the view with the keys as of `start - 1` (keys only: cheap), so a
        // later relist can also report deletions of keys the consumer already had.
        let (start, seed) = match from {
            None => {
                let listing = self.inner.range(prefix, None, true).await?;
                (listing.revision + 1, listing.items)
            }
            // etcd's first revision is 1 (an empty store), so seeding from
            // revision 1 is an empty seed that still detects compaction.
            Some(from) => match self.inner.range(prefix, Some((from - 1).max(1)), true).await {
                Ok(listing) => (from.max(1), listing.items),
                Err(KvError::Compacted { .. }) => {
                    return Err(KvError::Compacted { compact_revision: self.inner.probe_compact_revision().await });
                }
                Err(e) => return Err(e),
            },
        };
        let view = WatchView::new(start, seed.into_iter().map(|kv| (kv.key, kv.mod_revision)));
        let (tx, rx) = mpsc::channel(self.inner.config.watch_buffer.max(1));
        let span = tracing::debug_span!("etcd_watch", prefix, start);
        tokio::spawn(run_watch(self.inner.clone(), prefix.to_owned(), view, tx).instrument(span));
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        // etcd leases are whole seconds; round up so a lease never lives shorter
        // than asked.
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let secs =
            i64::try_from(secs.max(1)).map_err(|_| KvError::InvalidArgument(format!("lease TTL {ttl:?} too long")))?;
        let mut lease = self.inner.clients().lease.clone();
        let resp = self.inner.call("grant lease", lease.grant(secs, None)).await?;
        if !resp.error().is_empty() {
            return Err(KvError::Backend(format!("lease grant: {}", resp.error())));
        }
        Ok(Lease { id: resp.id(), ttl: Duration::from_secs(resp.ttl().max(0) as u64) })
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        // A fresh keep-alive stream per renewal: a renewal every TTL/3 is cheap,
        // and a stream that died with the connection never needs repairing.
        let mut client = self.inner.clients().lease.clone();
        let (_keeper, _stream) = self
            .inner
            .call("lease keep-alive", client.keep_alive(lease))
            .await
            .map_err(|e| KvError::from(e).with_lease(Some(lease)))?;
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        let mut client = self.inner.clients().lease.clone();
        self.inner
            .call("revoke lease", client.revoke(lease))
            .await
            .map_err(|e| KvError::from(e).with_lease(Some(lease)))?;
        Ok(())
    }

    async fn create(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Created> {
        let size = key.len() + value.len();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, Vec::from(value), put_options(lease))])
            .or_else([TxnOp::get(key, None)]);
        let resp =
            self.inner.txn("create", txn).await.map_err(|e| KvError::from(e).with_size(size).with_lease(lease))?;
        if resp.succeeded() {
            Ok(Created { won: true, revision: header_revision(resp.header()) })
        } else {
            Ok(Created { won: false, revision: txn_get_mod_revision(&resp) })
        }
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Revision,
        value: Bytes,
        lease: Option<LeaseId>,
    ) -> Result<Revision> {
        let size = key.len() + value.len();
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, expected)])
            .and_then([TxnOp::put(key, Vec::from(value), put_options(lease))])
            .or_else([TxnOp::get(key, None)]);
        let resp = self
            .inner
            .txn("compare-and-swap", txn)
            .await
            .map_err(|e| KvError::from(e).with_size(size).with_lease(lease))?;
        if resp.succeeded() {
            Ok(header_revision(resp.header()))
        } else {
            Err(KvError::Conflict { key: key.to_owned(), current_revision: txn_get_mod_revision(&resp) })
        }
    }

    async fn delete_if_revision(&self, key: &str, expected: Revision) -> Result<Revision> {
        let txn = Txn::new()
            .when([Compare::mod_revision(key, CompareOp::Equal, expected)])
            .and_then([TxnOp::delete(key, None)])
            .or_else([TxnOp::get(key, None)]);
        let resp = self.inner.txn("delete-if-revision", txn).await?;
        if resp.succeeded() {
            Ok(header_revision(resp.header()))
        } else {
            Err(KvError::Conflict { key: key.to_owned(), current_revision: txn_get_mod_revision(&resp) })
        }
    }

    async fn current_revision(&self) -> Result<Revision> {
        let mut kv = self.inner.clients().kv.clone();
        let resp =
            self.inner.call("current revision", kv.get(vec![0u8], Some(GetOptions::new().with_count_only()))).await?;
        Ok(header_revision(resp.header()))
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let mut kv = self.inner.clients().kv.clone();
        // Physical: when this returns, watches behind `revision` are cancelled
        // and reads below it fail, which is what callers (and tests) expect.
        let options = CompactionOptions::new().with_physical();
        match self.inner.call("compact", kv.compact(revision, Some(options))).await.map_err(KvError::from) {
            Ok(_) | Err(KvError::Compacted { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The body of one watch: (re)create the server-side watch from the first
/// undelivered revision, forward events, relist on compaction; until the
/// consumer drops the stream.
async fn run_watch(inner: Arc<Inner>, prefix: String, mut view: WatchView, tx: mpsc::Sender<Result<WatchEvent>>) {
    let end = prefix_end(prefix.as_bytes());
    let mut backoff = Backoff::new(inner.config.retry_min, inner.config.retry_max);
    'connect: loop {
        let options = WatchOptions::new()
            .with_range(end.clone())
            .with_start_revision(view.next_revision())
            .with_progress_notify();
        let mut client = inner.clients().watch.clone();
        let opened = tokio::select! {
            _ = tx.closed() => return,
            opened = inner.call("watch", client.watch(prefix.clone(), Some(options))) => opened,
        };
        let mut stream = match opened {
            Ok(stream) => stream,
            Err(e) => {
                debug!(error = %e, next_revision = view.next_revision(), "cannot open watch; retrying");
                if !sleep_unless_closed(&tx, backoff.next_delay()).await {
                    return;
                }
                continue 'connect;
            }
        };
        loop {
            let message = tokio::select! {
                _ = tx.closed() => return,
                message = stream.message() => message,
            };
            let resp = match message {
                Ok(Some(resp)) => resp,
                Ok(None) => {
                    debug!(next_revision = view.next_revision(), "watch stream ended; resuming");
                    if !sleep_unless_closed(&tx, backoff.next_delay()).await {
                        return;
                    }
                    continue 'connect;
                }
                Err(e) => {
                    debug!(error = %e, next_revision = view.next_revision(), "watch stream broke; resuming");
                    if !sleep_unless_closed(&tx, backoff.next_delay()).await {
                        return;
                    }
                    continue 'connect;
                }
            };
            if resp.created() {
                debug!(next_revision = view.next_revision(), "watch established");
                backoff.reset();
            }
            if resp.canceled() {
                if resp.compact_revision() > 0 {
                    info!(
                        compact_revision = resp.compact_revision(),
                        next_revision = view.next_revision(),
                        "watch fell behind compaction; relisting"
                    );
                    if !relist(&inner, &prefix, &mut view, &tx, &mut backoff).await {
                        return;
                    }
                } else {
                    warn!(reason = resp.cancel_reason(), "watch cancelled by etcd; re-creating");
                    if !sleep_unless_closed(&tx, backoff.next_delay()).await {
                        return;
                    }
                }
                continue 'connect;
            }
            let events: Vec<WatchEvent> = resp.events().iter().filter_map(convert_event).collect();
            if events.is_empty() {
                // A progress notification (never the creation response, whose
                // header may run ahead of a replay still to come): everything up
                // to its revision has been delivered, so resume after it.
                if !resp.created()
                    && let Some(header) = resp.header()
                {
                    view.advance_to(header.revision());
                }
                continue;
            }
            for event in view.accept_batch(events) {
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Relists the prefix and emits the difference to the consumer. Retries until it
/// succeeds; false when the consumer went away.
async fn relist(
    inner: &Inner,
    prefix: &str,
    view: &mut WatchView,
    tx: &mpsc::Sender<Result<WatchEvent>>,
    backoff: &mut Backoff,
) -> bool {
    loop {
        let listed = tokio::select! {
            _ = tx.closed() => return false,
            listed = inner.range(prefix, None, false) => listed,
        };
        match listed {
            Ok(listing) => {
                let revision = listing.revision;
                let events = view.resync(listing);
                info!(revision, changes = events.len(), "relisted after compaction");
                for event in events {
                    if tx.send(Ok(event)).await.is_err() {
                        return false;
                    }
                }
                return true;
            }
            Err(e) => {
                warn!(error = %e, "relist failed; retrying");
                if !sleep_unless_closed(tx, backoff.next_delay()).await {
                    return false;
                }
            }
        }
    }
}

/// Sleeps, waking early if the consumer drops the stream; false in that case.
async fn sleep_unless_closed(tx: &mpsc::Sender<Result<WatchEvent>>, delay: Duration) -> bool {
    tokio::select! {
        _ = tx.closed() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

fn put_options(lease: Option<LeaseId>) -> Option<PutOptions> {
    lease.map(|lease| PutOptions::new().with_lease(lease))
}

fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Revision {
    header.map(|h| h.revision()).unwrap_or(0)
}

/// Modification revision from the `get` in a failed transaction's else branch
/// (0 when the key does not exist).
fn txn_get_mod_revision(resp: &TxnResponse) -> Revision {
    resp.op_responses()
        .into_iter()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().first().map(|kv| kv.mod_revision()).unwrap_or(0)),
            _ => None,
        })
        .unwrap_or(0)
}

fn key_string(key: Vec<u8>) -> String {
    String::from_utf8(key).unwrap_or_else(|e| {
        let key = String::from_utf8_lossy(e.as_bytes()).into_owned();
        warn!(key, "non-UTF-8 key in etcd; shown lossily");
        key
    })
}

fn convert_kv(kv: etcd_client::KeyValue) -> KeyValue {
    let (create_revision, mod_revision, version, lease) =
        (kv.create_revision(), kv.mod_revision(), kv.version(), kv.lease());
    let (key, value) = kv.into_key_value();
    KeyValue {
        key: key_string(key),
        value: Bytes::from(value),
        create_revision,
        mod_revision,
        version,
        lease: (lease != 0).then_some(lease),
    }
}

fn convert_event(event: &etcd_client::Event) -> Option<WatchEvent> {
    let kv = event.kv()?;
    let value = match event.event_type() {
        etcd_client::EventType::Put => Some(Bytes::copy_from_slice(kv.value())),
        etcd_client::EventType::Delete => None,
    };
    Some(WatchEvent { key: key_string(kv.key().to_vec()), value, mod_revision: kv.mod_revision() })
}

/// An etcd failure before translation: keeps the original for the few cases
/// that need it (page-size fallback).
#[derive(Debug)]
enum RawError {
    Etcd(etcd_client::Error),
    Timeout(&'static str, Duration),
}

impl std::fmt::Display for RawError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RawError::Etcd(e) => write!(f, "{e}"),
            RawError::Timeout(what, after) => write!(f, "{what} timed out after {after:?}"),
        }
    }
}

impl RawError {
    /// The client refused a response bigger than its decoding limit.
    fn is_response_too_large(&self) -> bool {
        match self {
            RawError::Etcd(etcd_client::Error::GRpcStatus(status)) => {
                status.message().contains("message length too large")
                    || (status.code() == tonic::Code::OutOfRange && status.message().contains("decoded message"))
            }
            _ => false,
        }
    }
}

impl From<RawError> for KvError {
    fn from(e: RawError) -> Self {
        match e {
            RawError::Etcd(e) => map_err(e),
            RawError::Timeout(what, after) => KvError::Unavailable(format!("{what} timed out after {after:?}")),
        }
    }
}

impl KvError {
    /// Fills in the request size on a size error (etcd does not echo it).
    fn with_size(self, size: usize) -> Self {
        match self {
            KvError::TooLarge { limit, .. } => KvError::TooLarge { size, limit },
            other => other,
        }
    }

    /// Fills in the lease id on a lease error (etcd does not echo it).
    fn with_lease(self, lease: Option<LeaseId>) -> Self {
        match (self, lease) {
            (KvError::LeaseNotFound(_), Some(id)) => KvError::LeaseNotFound(id),
            (other, _) => other,
        }
    }
}

/// Translates etcd-client errors. etcd reports most conditions as gRPC status
/// messages (`etcdserver: ...`, `mvcc: ...`), so the message decides before the code.
fn map_err(e: etcd_client::Error) -> KvError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(status) => map_status(&status),
        E::TransportError(e) => KvError::Unavailable(format!("transport: {e}")),
        E::IoError(e) => KvError::Unavailable(format!("i/o: {e}")),
        E::WatchError(m) => KvError::Unavailable(format!("watch: {m}")),
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => KvError::LeaseNotFound(0),
        E::LeaseKeepAliveError(m) => KvError::Unavailable(format!("lease keep-alive: {m}")),
        E::InvalidArgs(m) => KvError::InvalidArgument(m),
        E::InvalidUri(e) => KvError::InvalidArgument(format!("endpoint: {e}")),
        other => KvError::Backend(other.to_string()),
    }
}

/// The chain under a transport failure: tonic's own message is only "transport error",
/// and what an operator needs is below it (say, the server's TLS alert refusing our
/// client certificate).
fn with_causes(message: &str, error: &dyn std::error::Error) -> String {
    let mut text = message.to_owned();
    let mut cause = error.source();
    while let Some(error) = cause {
        let line = error.to_string();
        // Layers often repeat the message below them.
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        cause = error.source();
    }
    text
}

fn map_status(status: &tonic::Status) -> KvError {
    use tonic::Code;
    let message = status.message();
    if message.contains("required revision has been compacted") {
        return KvError::Compacted { compact_revision: 0 };
    }
    if message.contains("requested lease not found") || message.contains("lease not found") {
        return KvError::LeaseNotFound(0);
    }
    if message.contains("request is too large") {
        return KvError::TooLarge { size: 0, limit: crate::DEFAULT_MAX_REQUEST_BYTES };
    }
    if message.contains("future revision") {
        return KvError::InvalidArgument(message.to_owned());
    }
    match status.code() {
        // The server's gRPC layer refusing an oversized message.
        Code::ResourceExhausted if message.contains("larger than max") => KvError::TooLarge { size: 0, limit: 0 },
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Unknown
        | Code::Aborted
        | Code::ResourceExhausted => {
            KvError::Unavailable(format!("{:?}: {}", status.code(), with_causes(message, status)))
        }
        Code::InvalidArgument | Code::OutOfRange => KvError::InvalidArgument(message.to_owned()),
        code => KvError::Backend(format!("{code:?}: {message}")),
    }
}
