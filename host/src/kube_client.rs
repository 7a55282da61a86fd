//! The Kubernetes client: kube's own stack (TLS, credentials, timeouts, retries, extra
//! headers), built here only to bound each connection's read buffer.
//!
//! hyper grows a connection's read buffer while reads fill it, up to ~400 KiB, and never
//! shrinks it. Every watch is a long-lived connection whose initial list (a streaming list)
//! arrives in one burst, so each kept the buffer that burst grew for good: 0.7 MiB of the
//! host's 5.8 MiB of live heap at 1k services (heaptrack, forty-second run in BENCHMARKS.md).
//! After the initial list a watch carries a few events at a time.
//!
//! kube's stack also logs each request (its `TraceLayer`, from tower-http); [`RequestLog`]
//! does the same here without that crate in the host: each attempt at debug level in a
//! span of its method and path, a server error at warn.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use tower::{BoxError, Service, ServiceBuilder};
use tracing::Instrument as _;

/// Each connection's largest read buffer (hyper's default is ~400 KiB; 8 KiB is its least).
/// Reads of this size keep the initial list's cost per byte where it was (BENCHMARKS.md).
pub const READ_BUFFER_MAX: usize = 32 * 1024;

/// A client for `config` as `kube::Client::try_from` builds it, with each connection's read
/// buffer bounded by [`READ_BUFFER_MAX`]. A proxy (`proxy_url`) is left to kube's own stack.
pub fn client(config: kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    if config.cluster_url.scheme_str() == Some("http") {
        // No TLS to set up: kube's stack would load every web PKI root for a URL that needs none.
        return with_connector(http, config);
    }
    // The scheme is the TLS connector's to check: it takes `https` URLs too.
    http.enforce_http(false);
    let https = config.rustls_https_connector_with_connector(http)?;
    with_connector(https, config)
}

/// The rest of kube's stack over `connector`: timeouts, the bounded buffer, the base URI,
/// retries, credentials and extra headers.
fn with_connector<C>(connector: C, config: kube::Config) -> Result<kube::Client, kube::Error>
where
    C: tower::Service<http::Uri> + Clone + Send + Sync + 'static,
    C::Response:
        hyper_util::client::legacy::connect::Connection + hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    let mut connector = hyper_timeout::TimeoutConnector::new(connector);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let http_client = hyper_util::client::legacy::Builder::new(TokioExecutor::new())
        .http1_max_buf_size(READ_BUFFER_MAX)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .layer_fn(RequestLog)
        .map_err(BoxError::from)
        .service(http_client);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// Logs each request the client sends (each retry too: it sits below the retry layer), as
/// kube's own stack does: at debug level with its status and duration, a server error (5xx)
/// at warn, a failure to get an answer at debug (the watchers log what they make of it).
/// Only the path is logged: a query can carry a continue token or a label selector's values.
#[derive(Clone, Debug)]
pub struct RequestLog<S>(pub S);

impl<S, B, R> Service<http::Request<B>> for RequestLog<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let span = tracing::debug_span!("kube_request", method = %request.method(), path = request.uri().path());
        let started = std::time::Instant::now();
        let answer = self.0.call(request);
        Box::pin(
            async move {
                let answer = answer.await;
                let elapsed_ms = started.elapsed().as_secs_f64() * 1e3;
                match &answer {
                    Ok(response) if response.status().is_server_error() => {
                        tracing::warn!(
                            status = response.status().as_u16(),
                            elapsed_ms,
                            "the API server answered with a server error"
                        )
                    }
                    Ok(response) => tracing::debug!(status = response.status().as_u16(), elapsed_ms, "answered"),
                    Err(e) => tracing::debug!(elapsed_ms, "no answer: {e}"),
                }
                answer
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use tower::ServiceExt as _;

    use super::*;

    /// What the log writes, kept for the test to read.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The log lines of `requests` sent through a [`RequestLog`] over a server answering
    /// each path's status (`/down`: no answer at all).
    async fn logged(requests: &[&str]) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let server = tower::service_fn(|request: http::Request<()>| async move {
            let status = match request.uri().path() {
                "/down" => return Err("connection refused".to_string()),
                "/api/v1/pods" => 200,
                _ => 503,
            };
            Ok(http::Response::builder().status(status).body(()).unwrap())
        });
        let mut client = RequestLog(server);
        for uri in requests {
            let request = http::Request::get(*uri).body(()).unwrap();
            let _ = client.ready().await.unwrap().call(request).await;
        }
        String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
    }

    #[tokio::test]
    async fn each_request_is_logged_with_its_status_and_a_server_error_warns() {
        let log =
            logged(&["/api/v1/pods?labelSelector=secret%3Dvalue", "/apis/discovery.k8s.io/v1/endpointslices", "/down"])
                .await;
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 3, "{log}");
        assert!(
            lines[0].contains("DEBUG")
                && lines[0].contains("method=GET")
                && lines[0].contains("path=\"/api/v1/pods\"")
                && lines[0].contains("status=200"),
            "{log}"
        );
        assert!(!log.contains("secret"), "the query is not logged: {log}");
        assert!(
            lines[1].contains("WARN") && lines[1].contains("status=503") && lines[1].contains("endpointslices"),
            "{log}"
        );
        assert!(lines[2].contains("DEBUG") && lines[2].contains("no answer: connection refused"), "{log}");
    }
}
