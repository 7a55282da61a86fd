//! Prometheus metrics (text exposition at `/metrics`).

use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use wasmplane_grpc::ModelFeed;
use wasmplane_grpc::tonic::Code;

use crate::dataplane::WriteHealth;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GuestLabels {
    pub module: String,
    pub kind: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The guest's kind, as in [`GuestLabels`]: `service-translator`, `network-policy`.
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModuleLabels {
    pub module: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyPacketLabels {
    pub namespace: String,
    pub name: String,
    /// `dropped` (enforced) or `would_drop` (audit mode).
    pub verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabels {
    /// `internal` or `external`, as kube-proxy labels it.
    pub traffic_policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabels {
    /// `netlink` (a batch on the host's socket), `nft` (an `nft -f` process) or `record`.
    pub path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    /// Another cluster's name (`--cluster-name` there).
    pub cluster: String,
}

/// What other clusters' services bring here (global services).
#[derive(Clone, Default)]
pub struct ClusterMeshGauges {
    /// 1 once a remote cluster's etcd answered (`--remote-cluster`), 0 while it is tried.
    pub remote_cluster_ready: Family<ClusterLabels, Gauge>,
    /// Endpoints imported from each other cluster.
    pub imported_endpoints: Family<ClusterLabels, Gauge>,
}

pub struct Metrics {
    pub registry: Registry,
    pub clustermesh: ClusterMeshGauges,
    pub events: Counter,
    pub revisions: Counter,
    pub guest_calls: Family<GuestLabels, Counter>,
    /// By guest kind: a translator call and a policy compile differ in cost and in count.
    pub guest_call_seconds: Family<KindLabels, Histogram, fn() -> Histogram>,
    /// One dataplane transaction, guest calls excluded (nft's share of a change).
    pub dataplane_sync_seconds: Histogram,
    /// One full write of the tables (reconcile, a new translator, a relayout): kube-proxy's
    /// `sync_full_proxy_rules_duration_seconds`.
    pub dataplane_full_sync_seconds: Histogram,
    /// Whether writes reach the kernel: the dataplane's, read at each scrape for
    /// `dataplane_last_sync_timestamp_seconds`.
    pub dataplane_health: Arc<WriteHealth>,
    /// Services whose `Local` traffic policy finds no endpoint on this node, by policy.
    pub service_ports_without_local_endpoints: Family<TrafficPolicyLabels, Gauge>,
    /// One batch of source events applied: cluster index, model update, guest calls and the
    /// dataplane transaction (the host's share of a change, from channel to kernel).
    pub source_apply_seconds: Histogram,
    /// kube-proxy's network programming SLI: from a slice's trigger time to its rules written.
    pub network_programming_seconds: Histogram,
    pub invalid_outputs: Counter,
    pub syncs: Family<ResultLabels, Counter>,
    pub sync_statements: Counter,
    /// Incremental dataplane transactions by how they reached the kernel.
    pub dataplane_transactions: Family<PathLabels, Counter>,
    pub module_uploads: Family<ResultLabels, Counter>,
    pub services: Gauge,
    pub policies: Gauge,
    pub local_pods: Gauge,
    pub auto_rollbacks: Family<ModuleLabels, Counter>,
    /// 1 while a policy is in audit mode on this node.
    pub policy_audit: Family<PolicyLabels, Gauge>,
    /// Packets a policy dropped or would have dropped, as of the last read of the kernel's counters.
    pub policy_packets: Family<PolicyPacketLabels, Gauge>,
    /// The gRPC model stream's feed, once it is served: its counters are read at each scrape.
    model_feed: Arc<OnceLock<ModelFeed>>,
    /// The operator role's GC counts (`gc_*`), once it runs here.
    gc: Arc<OnceLock<Arc<wasmplane_operator::GcStats>>>,
    /// The policy verdict log's totals, once the host reads it. Weak: the log's reading thread
    /// ends (and lets go of its NFLOG group) when the host stops, metrics or not.
    policy_verdicts: Arc<OnceLock<std::sync::Weak<crate::policy_log::PolicyVerdictLog>>>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("wasmplane");
        let m = Metrics {
            events: Counter::default(),
            revisions: Counter::default(),
            guest_calls: Family::default(),
            guest_call_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_01, 4.0, 10))),
            dataplane_sync_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            dataplane_full_sync_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            dataplane_health: Arc::default(),
            service_ports_without_local_endpoints: Family::default(),
            source_apply_seconds: Histogram::new(exponential_buckets(0.000_1, 2.0, 18)),
            // The host's part is milliseconds; the rest (the EndpointSlice controller, the
            // watch) can take seconds, and the SLO is read at 30 s and beyond.
            network_programming_seconds: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            ]),
            invalid_outputs: Counter::default(),
            syncs: Family::default(),
            sync_statements: Counter::default(),
            dataplane_transactions: Family::default(),
            module_uploads: Family::default(),
            services: Gauge::default(),
            policies: Gauge::default(),
            local_pods: Gauge::default(),
            auto_rollbacks: Family::default(),
            policy_audit: Family::default(),
            policy_packets: Family::default(),
            clustermesh: ClusterMeshGauges::default(),
            model_feed: Arc::default(),
            gc: Arc::default(),
            policy_verdicts: Arc::default(),
            registry: Registry::default(),
        };
        registry.register(
            "clustermesh_remote_cluster_ready",
            "1 once the remote cluster's etcd answered and its services are followed, 0 while it is tried",
            m.clustermesh.remote_cluster_ready.clone(),
        );
        registry.register(
            "clustermesh_imported_endpoints",
            "Endpoints of other clusters' global services imported here, by cluster",
            m.clustermesh.imported_endpoints.clone(),
        );
        registry.register("model_events", "Cluster events received by the model", m.events.clone());
        registry.register("model_revisions", "Node-local model revisions produced", m.revisions.clone());
        registry.register("guest_calls", "Guest calls by module and result", m.guest_calls.clone());
        registry.register(
            "guest_call_seconds",
            "Duration of one guest call, by guest kind",
            m.guest_call_seconds.clone(),
        );
        registry.register(
            "dataplane_transactions",
            "Incremental dataplane transactions by path (netlink batch, nft process, record)",
            m.dataplane_transactions.clone(),
        );
        registry.register(
            "dataplane_sync_seconds",
            "Duration of one incremental dataplane transaction",
            m.dataplane_sync_seconds.clone(),
        );
        registry.register(
            "dataplane_full_sync_seconds",
            "Duration of one full write of the dataplane's tables",
            m.dataplane_full_sync_seconds.clone(),
        );
        registry.register_collector(Box::new(WriteHealthCollector(m.dataplane_health.clone())));
        registry.register(
            "model_service_ports_without_local_endpoints",
            "Service ports whose Local traffic policy (internal, external) finds no endpoint on this node: that traffic is dropped here",
            m.service_ports_without_local_endpoints.clone(),
        );
        registry.register(
            "source_apply_seconds",
            "Duration of applying one batch of cluster events: model update, guest calls and the dataplane transaction",
            m.source_apply_seconds.clone(),
        );
        registry.register(
            "network_programming_duration_seconds",
            "From the last-change-trigger-time of an EndpointSlice change to its service's rules written in the kernel (kube-proxy's network programming latency)",
            m.network_programming_seconds.clone(),
        );
        registry.register("guest_invalid_outputs", "Guest outputs rejected by validation", m.invalid_outputs.clone());
        registry.register("dataplane_syncs", "Dataplane transactions by result", m.syncs.clone());
        registry.register("dataplane_statements", "nftables statements written", m.sync_statements.clone());
        registry.register("module_uploads", "Module uploads by result", m.module_uploads.clone());
        registry.register("model_services", "Services in the node-local model", m.services.clone());
        registry.register("model_policies", "Network policies that select pods on this node", m.policies.clone());
        registry.register("model_local_pods", "Pods on this node", m.local_pods.clone());
        registry.register(
            "module_auto_rollbacks",
            "Modules rolled back after exhausting their crash budget",
            m.auto_rollbacks.clone(),
        );
        registry.register(
            "policy_audit_mode",
            "1 while the policy is in audit mode on this node (would-be drops counted, not enforced)",
            m.policy_audit.clone(),
        );
        registry.register(
            "policy_packets",
            "Packets the policy dropped, or in audit mode would have dropped (last read of the kernel's counters)",
            m.policy_packets.clone(),
        );
        registry.register_collector(Box::new(ModelFeedCollector(m.model_feed.clone())));
        registry.register_collector(Box::new(GcCollector(m.gc.clone())));
        registry.register_collector(Box::new(PolicyVerdictCollector(m.policy_verdicts.clone())));
        Metrics { registry, ..m }
    }

    /// Exports the gRPC model stream's counters (`grpc_*`) from now on. The host has one
    /// feed; a second one is ignored (with a warning) rather than mixed into the first's.
    pub fn export_model_feed(&self, feed: ModelFeed) {
        if self.model_feed.set(feed).is_err() {
            tracing::warn!("a second gRPC model feed is not exported to /metrics");
        }
    }

    /// Exports the operator role's GC counts (`gc_*`) from now on (one role per host).
    pub fn export_gc(&self, stats: Arc<wasmplane_operator::GcStats>) {
        if self.gc.set(stats).is_err() {
            tracing::warn!("a second GC is not exported to /metrics");
        }
    }

    pub fn export_policy_verdicts(&self, log: &Arc<crate::policy_log::PolicyVerdictLog>) {
        let _ = self.policy_verdicts.set(Arc::downgrade(log));
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }

    pub fn guest_call(&self, module: &str, kind: &str, result: &str) {
        self.guest_calls
            .get_or_create(&GuestLabels { module: module.into(), kind: kind.into(), result: result.into() })
            .inc();
    }

    pub fn guest_call_time(&self, kind: &str, seconds: f64) {
        self.guest_call_seconds.get_or_create(&KindLabels { kind: kind.into() }).observe(seconds);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// `dataplane_last_sync_timestamp_seconds` (kube-proxy's `sync_proxy_rules_last_timestamp_seconds`),
/// read from the dataplane's write health at each scrape: an alert on its age catches a
/// writer that stopped, which counters alone do not.
#[derive(Debug)]
struct WriteHealthCollector(Arc<WriteHealth>);

impl Collector for WriteHealthCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let seconds = self
            .0
            .last_written()
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        let gauge = ConstGauge::new(seconds);
        let metric = encoder.encode_descriptor(
            "dataplane_last_sync_timestamp_seconds",
            "When the kernel last accepted a dataplane write (seconds since the Unix epoch; 0: none yet)",
            None,
            gauge.metric_type(),
        )?;
        gauge.encode(metric)
    }
}

/// The gRPC model stream's counters, read from its feed at each scrape (the feed counts with
/// atomics of its own; copying them into registered metrics would only add a lag). Nothing
/// while the stream is not served.
#[derive(Debug)]
struct ModelFeedCollector(Arc<OnceLock<ModelFeed>>);

impl ModelFeedCollector {
    /// Always exported, at 0 until one happens, so that rates and alerts work from the start:
    /// the codes the host's policy refuses with, and the one of a shutdown.
    const EXPECTED_REFUSALS: [Code; 3] = [Code::Unauthenticated, Code::PermissionDenied, Code::Unavailable];
}

impl Collector for ModelFeedCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(feed) = self.0.get() else { return Ok(()) };
        let stats = feed.stats();
        let subscribers = ConstGauge::new(stats.subscribers);
        subscribers.encode(encoder.encode_descriptor(
            "grpc_subscribers",
            "gRPC model watches streaming now",
            None,
            subscribers.metric_type(),
        )?)?;
        for (name, help, value) in [
            ("grpc_watches", "gRPC model watches started (refused ones not included)", stats.watches),
            ("grpc_revisions_published", "Model revisions published to the gRPC stream", stats.published),
            (
                "grpc_snapshots_sent",
                "Complete model snapshots sent over gRPC: each watch's first, and resyncs",
                stats.snapshots_sent,
            ),
            ("grpc_deltas_sent", "Model deltas sent over gRPC, over all watches", stats.deltas_sent),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }

        let mut resyncs = encoder.encode_descriptor(
            "grpc_resyncs",
            "Snapshots resent to a gRPC watch, by reason: lagged (the client read too slowly), gap (revisions published out of order, a host bug)",
            None,
            MetricType::Counter,
        )?;
        for (reason, value) in [("lagged", stats.resyncs_lagged), ("gap", stats.resyncs_gap)] {
            ConstCounter::new(value).encode(resyncs.encode_family(&[("reason", reason)])?)?;
        }

        let mut refused = encoder.encode_descriptor(
            "grpc_watches_refused",
            "gRPC model watches refused before they started, by status code (unauthenticated, permission_denied: the caller; unavailable: shutting down or the authorizer unreachable)",
            None,
            MetricType::Counter,
        )?;
        let unexpected = stats.refused.iter().filter(|(code, _)| !Self::EXPECTED_REFUSALS.contains(code));
        for (code, value) in
            Self::EXPECTED_REFUSALS.into_iter().map(|code| (code, stats.refused.get(code))).chain(unexpected)
        {
            ConstCounter::new(value).encode(refused.encode_family(&[("code", status_code_label(code))])?)?;
        }
        Ok(())
    }
}

/// The operator role's GC (every leading term of this process), read at each scrape.
#[derive(Debug)]
struct GcCollector(Arc<OnceLock<Arc<wasmplane_operator::GcStats>>>);

impl Collector for GcCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.0.get() else { return Ok(()) };
        let status = stats.status();
        let mut cycles = encoder.encode_descriptor(
            "gc_cycles",
            "GC cycles run while leading, by result (failed: listing, the GC guest or a delete; see GET /v1/operator)",
            None,
            MetricType::Counter,
        )?;
        for (result, value) in [("ok", status.cycles - status.failed_cycles), ("failed", status.failed_cycles)] {
            ConstCounter::new(value).encode(cycles.encode_family(&[("result", result)])?)?;
        }
        let mut deleted =
            encoder.encode_descriptor("gc_deleted", "Keys GC deleted, by candidate kind", None, MetricType::Counter)?;
        for (kind, value) in &status.deleted {
            ConstCounter::new(*value).encode(deleted.encode_family(&[("kind", kind.as_str())])?)?;
        }
        let offered = ConstGauge::new(status.last_offered as i64);
        offered.encode(encoder.encode_descriptor(
            "gc_candidates",
            "Candidates offered to the GC guest in the last successful cycle",
            None,
            offered.metric_type(),
        )?)?;
        if let Some(at) = status.last_success_unix {
            let at = ConstGauge::new(at as i64);
            at.encode(encoder.encode_descriptor(
                "gc_last_success_timestamp_seconds",
                "When the last GC cycle that did not fail ended (Unix time)",
                None,
                at.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[derive(Debug)]
struct PolicyVerdictCollector(Arc<OnceLock<std::sync::Weak<crate::policy_log::PolicyVerdictLog>>>);

impl Collector for PolicyVerdictCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(log) = self.0.get().and_then(std::sync::Weak::upgrade) else { return Ok(()) };
        let totals = log.totals();
        let mut logged = encoder.encode_descriptor("policy_verdicts_logged", "Packets the policy dispatch chains logged and the host read (rate-limited per pod and direction), by verdict (audit: would have been dropped; allow: connections a policy with allow logging accepted, rate-limited per policy and direction)", None, MetricType::Counter)?;
        for (verdict, value) in [("deny", totals.deny), ("audit", totals.audit), ("allow", totals.allow)] {
            ConstCounter::new(value).encode(logged.encode_family(&[("verdict", verdict)])?)?;
        }
        let mut dropped = encoder.encode_descriptor("service_drops_logged", "New connections the service side dropped or rejected, logged (rate-limited per node and reason) and read by the host, by reason", None, MetricType::Counter)?;
        for (reason, value) in log.service_totals() {
            ConstCounter::new(value).encode(dropped.encode_family(&[("reason", reason.name())])?)?;
        }
        let lost = ConstCounter::new(totals.lost);
        lost.encode(encoder.encode_descriptor(
            "policy_verdict_log_overruns",
            "Times the kernel dropped policy verdict messages before the host read them",
            None,
            lost.metric_type(),
        )?)?;
        Ok(())
    }
}

/// gRPC's canonical name of `code`, in lower case (`permission_denied`), as a label value.
fn status_code_label(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use wasmplane_grpc::proto::local_model_server::LocalModel as _;
    use wasmplane_grpc::{Delta, ModelFeed, NodeFacts, Snapshot, WatchService, proto, tonic};

    use super::*;

    /// The value of the sample `series` (name and labels) in `text`.
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[tokio::test]
    async fn the_model_feed_is_read_at_each_scrape_once_exported() {
        let metrics = Metrics::new();
        assert!(!metrics.encode().contains("grpc_"), "no feed, no gRPC metrics:\n{}", metrics.encode());

        let feed =
            ModelFeed::new(Arc::new(|| Snapshot { revision: 0, node: NodeFacts::default(), services: vec![] }), 4);
        metrics.export_model_feed(feed.clone());
        let text = metrics.encode();
        assert!(text.contains("# HELP wasmplane_grpc_watches_refused gRPC model watches refused"), "{text}");
        assert!(text.contains("# TYPE wasmplane_grpc_subscribers gauge"), "{text}");
        for series in [
            "wasmplane_grpc_subscribers",
            "wasmplane_grpc_watches_total",
            "wasmplane_grpc_revisions_published_total",
            "wasmplane_grpc_snapshots_sent_total",
            "wasmplane_grpc_deltas_sent_total",
            "wasmplane_grpc_resyncs_total{reason=\"lagged\"}",
            "wasmplane_grpc_resyncs_total{reason=\"gap\"}",
            "wasmplane_grpc_watches_refused_total{code=\"unauthenticated\"}",
            "wasmplane_grpc_watches_refused_total{code=\"permission_denied\"}",
            "wasmplane_grpc_watches_refused_total{code=\"unavailable\"}",
        ] {
            assert_eq!(sample(&text, series), Some(0.0), "{series} at 0 from the start:\n{text}");
        }

        // Counted by the feed, seen at the next scrape without anything copying them.
        for revision in 1..=3 {
            feed.publish(Delta { revision, node: None, changes: vec![] });
        }
        feed.close();
        let refused = WatchService::new(feed.clone())
            .watch(tonic::Request::new(proto::WatchRequest {}))
            .await
            .map(drop)
            .expect_err("a closed feed refuses");
        assert_eq!(refused.code(), Code::Unavailable);
        let text = metrics.encode();
        assert_eq!(sample(&text, "wasmplane_grpc_revisions_published_total"), Some(3.0), "{text}");
        assert_eq!(sample(&text, "wasmplane_grpc_watches_refused_total{code=\"unavailable\"}"), Some(1.0), "{text}");
        assert_eq!(sample(&text, "wasmplane_grpc_watches_total"), Some(0.0), "{text}");
    }

    #[test]
    fn service_drops_are_counted_by_reason_beside_the_policy_verdicts() {
        use crate::nft::service_drops::{ServiceDropReason, prefix};
        use crate::policy_log::{DropCause, DropEvent, PolicyVerdictLog};
        let metrics = Metrics::new();
        let log = PolicyVerdictLog::new();
        metrics.export_policy_verdicts(&log);
        let event = |reason| DropEvent {
            at_unix_ms: 1,
            cause: DropCause::Service { reason },
            source: "10.244.0.5".parse().unwrap(),
            destination: "10.96.0.40".parse().unwrap(),
            protocol: "tcp".into(),
            source_port: Some(40000),
            destination_port: Some(80),
        };
        log.record(event(ServiceDropReason::NoEndpoints));
        log.record(event(ServiceDropReason::NoEndpoints));
        log.record(event(ServiceDropReason::SourceRange));
        let text = metrics.encode();
        assert!(text.contains("# TYPE wasmplane_service_drops_logged counter"), "{text}");
        assert_eq!(sample(&text, "wasmplane_service_drops_logged_total{reason=\"no-endpoints\"}"), Some(2.0), "{text}");
        assert_eq!(sample(&text, "wasmplane_service_drops_logged_total{reason=\"source-range\"}"), Some(1.0), "{text}");
        assert_eq!(
            sample(&text, "wasmplane_service_drops_logged_total{reason=\"unallocated\"}"),
            Some(0.0),
            "every reason from the start: {text}"
        );
        assert_eq!(sample(&text, "wasmplane_policy_verdicts_logged_total{verdict=\"deny\"}"), Some(0.0), "{text}");
        assert_eq!(prefix(ServiceDropReason::NoEndpoints), "wasmplane-service no-endpoints");
    }

    #[test]
    fn status_codes_are_labelled_by_their_grpc_names() {
        assert_eq!(status_code_label(Code::PermissionDenied), "permission_denied");
        assert_eq!(status_code_label(Code::Unauthenticated), "unauthenticated");
        assert_eq!(status_code_label(Code::DeadlineExceeded), "deadline_exceeded");
    }
}
