//! The Kubernetes client: kube's own stack (TLS, credentials, timeouts, retries, extra
//! headers), built here only to bound each connection's read buffer.
//!
//! hyper grows a connection's read buffer while reads fill it, up to ~400 KiB, and never
//! shrinks it. Every watch is a long-lived connection whose initial list (a streaming list)
//! arrives in one burst, so each kept the buffer that burst grew for good: 0.7 MiB of the
//! host's 5.8 MiB of live heap at 1k services (heaptrack, forty-second run in BENCHMARKS.md).
//! After the initial list a watch carries a few events at a time.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use tower::{BoxError, ServiceBuilder};

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
    C::Response: hyper_util::client::legacy::connect::Connection + hyper::rt::Read + hyper::rt::Write + Send + Unpin + 'static,
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
        .option_layer(config.default_retry.then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http_client);
    Ok(kube::Client::new(service, config.default_namespace))
}
