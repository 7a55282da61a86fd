//! `--metrics-listen`: the Prometheus metrics alone, on an address of their own and without
//! a token, as kube-proxy serves its metrics (`--metrics-bind-address`, port 10249). The REST
//! API asks clients that are not on loopback for a token even to read; a scraper then needs
//! one, or the whole API must be exposed where only the metrics should be. This listener
//! answers `/metrics` and kube-proxy's `/proxyMode` (what writes the dataplane: `nftables`,
//! or `record` without a kernel; scripts that check a node's proxy ask it) and nothing else.

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::header;
use axum::routing::get;

use crate::api::ApiState;

/// How often a taken port is asked for again: where kube-proxy still runs on the node, it
/// holds 10249 until it goes.
const RETRY: Duration = Duration::from_secs(5);

/// Serves `/metrics` and `/proxyMode` (`proxy_mode`) on `listen`. Returns where it listens when the port could be bound at
/// once; when it is taken, binding is tried again every [`RETRY`] in the background and the
/// address is `None`. The task ends when aborted (the host's stop).
pub async fn start(
    listen: SocketAddr,
    state: ApiState,
    proxy_mode: &'static str,
) -> (Option<SocketAddr>, tokio::task::JoinHandle<()>) {
    let app = axum::Router::new()
        .route("/metrics", get(crate::api::metrics))
        .route(
            "/proxyMode",
            get(move || async move { ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], proxy_mode) }),
        )
        .with_state(state);
    match tokio::net::TcpListener::bind(listen).await {
        Ok(listener) => {
            let addr = listener.local_addr().ok();
            tracing::info!(listen = ?addr, "serving metrics without a token");
            (addr, tokio::spawn(serve(listener, app)))
        }
        Err(e) => {
            tracing::warn!(%listen, "cannot serve metrics (retrying every {RETRY:?}): {e}");
            (None, tokio::spawn(bind_then_serve(listen, app)))
        }
    }
}

async fn bind_then_serve(listen: SocketAddr, app: axum::Router) {
    let listener = loop {
        tokio::time::sleep(RETRY).await;
        match tokio::net::TcpListener::bind(listen).await {
            Ok(listener) => break listener,
            Err(e) => tracing::debug!(%listen, "cannot serve metrics yet: {e}"),
        }
    };
    tracing::info!(%listen, "serving metrics without a token");
    serve(listener, app).await;
}

async fn serve(listener: tokio::net::TcpListener, app: axum::Router) {
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!("metrics server failed: {e}");
    }
}
