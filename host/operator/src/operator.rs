//! The operator role in one call: every cluster-wide duty, run only while this
//! replica leads.
//!
//! [`Operator::start`] follows per-node policy status on every replica (so any
//! replica can answer status queries) and runs, while leading, the heartbeat,
//! the policy-status writer, the service sync and the mesh slice sync (if
//! configured) and GC (if a decider is given). Each duty is restarted after
//! `restart_delay` if it ends, and all stop within the leader's renew deadline
//! when leadership is lost.
//!
//! The service sync and the mesh slice sync follow every Service of the
//! cluster: they share one watch (`servicewatch`), itself run while
//! leading, so that the leader lists and watches the Services once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{Instrument, warn};
use wasmplane_kvstore::KvStore;

use crate::error::Result;
use crate::gc::{GarbageCollector, GcConfig, GcDecider};
use crate::heartbeat::{HEARTBEAT_KEY, write_heartbeats};
use crate::leader::Leadership;
use crate::meshslices::{MeshSliceConfig, sync_mesh_slices_from};
use crate::policystatus::{AggregatorConfig, PolicyStatusAggregator, PolicySummary};
use crate::services::{ServiceSyncConfig, sync_services_from};
use crate::servicewatch::ServiceWatch;

/// What the operator role runs.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    /// This replica's identity (written into the heartbeat).
    pub identity: String,
    pub heartbeat_key: String,
    pub heartbeat_interval: Duration,
    /// Service sync into the kvstore; `None`: not run.
    pub service_sync: Option<ServiceSyncConfig>,
    /// EndpointSlices for the remote clusters' endpoints of global Services.
    pub mesh_slices: Option<MeshSliceConfig>,
    pub aggregator: AggregatorConfig,
    pub gc: GcConfig,
    /// Delay before restarting a duty that ended (an error it could not ride out).
    pub restart_delay: Duration,
}

impl OperatorConfig {
    /// Heartbeat every minute, default aggregation and GC, no service sync.
    pub fn new(identity: impl Into<String>) -> Self {
        OperatorConfig {
            identity: identity.into(),
            heartbeat_key: HEARTBEAT_KEY.into(),
            heartbeat_interval: Duration::from_secs(60),
            service_sync: None,
            mesh_slices: None,
            aggregator: AggregatorConfig::default(),
            gc: GcConfig::default(),
            restart_delay: Duration::from_secs(1),
        }
    }
}

/// The running operator role. Dropping it stops every duty.
pub struct Operator {
    aggregator: PolicyStatusAggregator,
    tasks: Vec<JoinHandle<()>>,
}

impl Operator {
    /// Starts every duty. Fails if the kvstore cannot be read or a configuration
    /// is invalid; later errors are logged and the duty restarted.
    pub async fn start(
        store: Arc<dyn KvStore>,
        client: kube::Client,
        leadership: Leadership,
        gc_decider: Option<Arc<Mutex<dyn GcDecider>>>,
        config: OperatorConfig,
    ) -> Result<Self> {
        let aggregator =
            PolicyStatusAggregator::start(store.clone(), client.clone(), leadership.clone(), config.aggregator.clone())
                .await?;
        let delay = config.restart_delay;
        let mut tasks = Vec::new();

        let heartbeat = {
            let (store, leadership, config) = (store.clone(), leadership.clone(), config.clone());
            async move {
                leadership
                    .run_while_leading("heartbeat", delay, move || {
                        write_heartbeats(
                            store.clone(),
                            config.heartbeat_key.clone(),
                            config.identity.clone(),
                            config.heartbeat_interval,
                        )
                    })
                    .await
            }
        };
        tasks.push(tokio::spawn(heartbeat.instrument(tracing::info_span!("heartbeat"))));

        // The one Service watch of the duties that follow Services. Each start of a
        // duty subscribes: it gets the watch's complete list, at once or when listed.
        let services = (config.service_sync.is_some() || config.mesh_slices.is_some()).then(ServiceWatch::default);
        if let Some(watch) = services.clone() {
            let (client, leadership) = (client.clone(), leadership.clone());
            let duty = async move {
                leadership
                    .run_while_leading("service-watch", delay, move || {
                        let (watch, client) = (watch.clone(), client.clone());
                        async move { watch.run(client).await }
                    })
                    .await
            };
            tasks.push(tokio::spawn(duty.instrument(tracing::info_span!("service_watch"))));
        }

        if let (Some(sync), Some(watch)) = (config.service_sync.clone(), services.clone()) {
            let (store, client, leadership) = (store.clone(), client.clone(), leadership.clone());
            let duty = async move {
                leadership
                    .run_while_leading("service-sync", delay, move || {
                        let (store, client, sync) = (store.clone(), client.clone(), sync.clone());
                        let services = watch.subscribe();
                        async move {
                            if let Err(e) = sync_services_from(store, client, sync, services).await {
                                warn!(error = %e, "service sync stopped");
                            }
                        }
                    })
                    .await
            };
            tasks.push(tokio::spawn(duty.instrument(tracing::info_span!("service_sync"))));
        }

        if let (Some(mesh), Some(watch)) = (config.mesh_slices.clone(), services) {
            let (client, leadership) = (client.clone(), leadership.clone());
            let duty = async move {
                leadership
                    .run_while_leading("mesh-endpoint-slices", delay, move || {
                        sync_mesh_slices_from(client.clone(), mesh.clone(), watch.subscribe())
                    })
                    .await
            };
            tasks.push(tokio::spawn(duty.instrument(tracing::info_span!("mesh_endpoint_slices"))));
        }

        if let Some(decider) = gc_decider {
            // Validate once here so a bad configuration fails start-up, not every term.
            GarbageCollector::new(store.clone(), Some(client.clone()), decider.clone(), config.gc.clone())?;
            let (store, client, leadership, gc) =
                (store.clone(), client.clone(), leadership.clone(), config.gc.clone());
            let duty = async move {
                leadership
                    .run_while_leading("gc", delay, move || {
                        // A fresh collector per term: ages restart at zero, which
                        // only delays deletions.
                        let collector =
                            GarbageCollector::new(store.clone(), Some(client.clone()), decider.clone(), gc.clone());
                        async move {
                            match collector {
                                Ok(mut collector) => collector.run().await,
                                Err(e) => warn!(error = %e, "GC not started"),
                            }
                        }
                    })
                    .await
            };
            tasks.push(tokio::spawn(duty.instrument(tracing::info_span!("gc"))));
        }
        Ok(Operator { aggregator, tasks })
    }

    /// A policy's cluster-wide status (`GET /v1/policies/{ns}/{name}/status`).
    pub fn policy_status(&self, namespace: &str, name: &str) -> Option<PolicySummary> {
        self.aggregator.summary(namespace, name)
    }

    /// The aggregator, for its write counter.
    pub fn aggregator(&self) -> &PolicyStatusAggregator {
        &self.aggregator
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
