//! The audit log: one record per mutating REST call, refused ones included.
//!
//! Each record says who (identity from [`crate::auth`], peer address), what (method, path
//! with query, response status) and, for module uploads, the sha256 digest of the bytes
//! sent. It goes to the log (`tracing` target `audit`) and to the kvstore under
//! `/wasmplane/audit/<node>/<unix nanos, zero-padded to 20 digits>` as JSON, so keys sort by
//! time and every host's records are in one place. A slow or unavailable kvstore never
//! holds a request for more than [`WRITE_TIMEOUT`]; writes that fail are counted in
//! `wasmplane_audit_write_failures_total`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use http_body::Frame;
use prometheus_client::metrics::counter::Counter;
use serde::Serialize;
use sha2::{Digest as _, Sha256};
use wasmplane_kvstore::KvStore;

use crate::api::ApiState;
use crate::auth::Identity;

pub const AUDIT_PREFIX: &str = "/wasmplane/audit/";

/// Longest a request waits for its audit record to reach the kvstore; the write goes on
/// in the background after that.
pub const WRITE_TIMEOUT: Duration = Duration::from_millis(250);

/// Audit writes allowed in flight; beyond this (a kvstore that stopped answering) records
/// go to the log only and count as failures, so waiting writes cannot pile up.
const MAX_IN_FLIGHT: usize = 256;

/// One audit record (the kvstore value).
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct AuditRecord {
    pub time_unix_nanos: u64,
    pub node: String,
    /// `static-token`, a Kubernetes username, or `anonymous` (refused before identification).
    pub user: String,
    /// `token`, `kubernetes`, or `none`.
    pub auth: String,
    pub peer: String,
    pub method: String,
    pub path: String,
    pub status: u16,
    /// `sha256:<hex>` of an upload's body (when the body was read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// Where audit records go.
pub struct Audit {
    kv: Arc<dyn KvStore>,
    node: String,
    failures: Counter,
    last_nanos: AtomicU64,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Audit {
    /// `failures`: a counter registered in the host's metrics.
    pub fn new(kv: Arc<dyn KvStore>, node: String, failures: Counter) -> Audit {
        Audit {
            kv,
            node,
            failures,
            last_nanos: AtomicU64::new(0),
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    pub fn failures(&self) -> u64 {
        self.failures.get()
    }

    /// A strictly increasing timestamp, so two records never share a key.
    fn next_nanos(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut last = self.last_nanos.load(Ordering::Relaxed);
        loop {
            let next = now.max(last + 1);
            match self.last_nanos.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return next,
                Err(seen) => last = seen,
            }
        }
    }

    /// The kvstore key of a record.
    pub fn key(node: &str, nanos: u64) -> String {
        format!("{AUDIT_PREFIX}{node}/{nanos:020}")
    }

    async fn record(&self, mut record: AuditRecord) {
        record.time_unix_nanos = self.next_nanos();
        record.node = self.node.clone();
        tracing::info!(
            target: "audit",
            user = %record.user,
            auth = %record.auth,
            peer = %record.peer,
            method = %record.method,
            path = %record.path,
            status = record.status,
            digest = record.digest.as_deref().unwrap_or(""),
            "api call"
        );
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            self.failures.inc();
            tracing::warn!(target: "audit", "too many audit writes in flight; record kept in the log only");
            return;
        };
        let key = Audit::key(&self.node, record.time_unix_nanos);
        let value = Bytes::from(serde_json::to_vec(&record).expect("audit records serialize"));
        let (kv, failures) = (self.kv.clone(), self.failures.clone());
        let write = tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = kv.put(&key, value, None).await {
                failures.inc();
                tracing::warn!(target: "audit", %key, "writing the audit record to the kvstore failed: {e}");
            }
        });
        if tokio::time::timeout(WRITE_TIMEOUT, write).await.is_err() {
            tracing::warn!(target: "audit", "the kvstore is slow: audit write still pending after {WRITE_TIMEOUT:?}, not waiting for it");
        }
    }
}

/// Feeds a request body through sha256 as the handler reads it: the digest of an upload
/// without buffering it a second time, and without reading anything before authentication
/// (a refused request's body is read after the refusal, to be dropped, and hashed then).
struct HashingBody {
    inner: Body,
    hasher: Option<Sha256>,
    out: Arc<Mutex<Option<String>>>,
}

impl HashingBody {
    fn finish(&mut self) {
        if let Some(hasher) = self.hasher.take() {
            *self.out.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("sha256:{}", hex::encode(hasher.finalize())));
        }
    }
}

impl http_body::Body for HashingBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(hasher)) = (frame.data_ref(), this.hasher.as_mut()) {
                    hasher.update(data);
                }
                if this.inner.is_end_stream() {
                    this.finish();
                }
            }
            Poll::Ready(None) => this.finish(),
            // A body that failed midway has no digest.
            Poll::Ready(Some(Err(_))) => this.hasher = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Middleware: records every mutating call after it is answered. Outermost layer, so
/// refused authentication is recorded too; the identity comes back in the response's
/// extensions from the authentication layer.
pub async fn audit_layer(
    State(state): State<ApiState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(request).await;
    }
    let method = request.method().to_string();
    let path =
        request.uri().path_and_query().map(|p| p.to_string()).unwrap_or_else(|| request.uri().path().to_string());
    let is_upload = *request.method() == Method::PUT && request.uri().path().starts_with("/v1/modules/");
    let digest = Arc::new(Mutex::new(None));
    let request = if is_upload {
        let (parts, body) = request.into_parts();
        Request::from_parts(
            parts,
            Body::new(HashingBody { inner: body, hasher: Some(Sha256::new()), out: digest.clone() }),
        )
    } else {
        request
    };
    let response = next.run(request).await;
    let identity = response.extensions().get::<Identity>().cloned();
    let record = AuditRecord {
        time_unix_nanos: 0,
        node: String::new(),
        user: identity.as_ref().map(|i| i.user.clone()).unwrap_or_else(|| "anonymous".into()),
        auth: identity.as_ref().map(|i| i.method.to_string()).unwrap_or_else(|| "none".into()),
        peer: peer.to_string(),
        method,
        path,
        status: response.status().as_u16(),
        digest: digest.lock().unwrap_or_else(|p| p.into_inner()).take(),
    };
    state.audit.record(record).await;
    response
}
