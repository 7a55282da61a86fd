//! Leader election on a `coordination.k8s.io/v1` Lease, and running duties only
//! while leading.
//!
//! Why not a crate: the maintained one for kube 5 (`kube-lease-manager`) acquires
//! through server-side apply and renews with unconditioned patches, so its
//! mutual exclusion rests on field-ownership conflicts. Here every write is a
//! `replace` carrying the `resourceVersion` that was read, exactly like
//! client-go's `LeaseLock`: of two replicas racing for one lease, the server
//! lets exactly one write through and answers the other 409 Conflict.
//!
//! Timing (L = lease duration, written as `leaseDurationSeconds`):
//! - the leader renews every L/3 and believes it leads only until
//!   `start of its last successful renewal + renew deadline` (default 2L/3);
//!   past that, or on a conflict, it steps down at once;
//! - a follower takes over only after it has seen the *same* lease record
//!   (holder, renew time, resourceVersion) for a full L by its own clock, so
//!   clock skew between machines does not matter, only clock rate;
//! - as the follower's observation starts after the leader's renewal was sent,
//!   the old leader has stepped down at least L/3 before anyone else acquires.
//!
//! Duties run through [`Leadership::run_while_leading`], which cancels them the
//! moment leadership is lost (at the latest at the renew deadline, so within one
//! lease period) and waits until they have really stopped.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{Instrument, debug, info, warn};

use crate::error::{Error, Result, api_status};

/// Where and how to elect.
#[derive(Debug, Clone)]
pub struct LeaderElectionConfig {
    /// Namespace of the Lease object.
    pub namespace: String,
    /// Name of the Lease object; replicas electing among themselves share it.
    pub lease_name: String,
    /// This replica's identity, unique among the candidates (e.g. the pod name).
    pub identity: String,
    /// How long a lease is valid without renewal. Whole seconds (rounded up):
    /// that is what the Lease object can hold.
    pub lease_duration: Duration,
    /// How long the leader keeps believing it leads after the start of its last
    /// successful renewal. Must be below `lease_duration`.
    pub renew_deadline: Duration,
    /// How often the leader renews and a follower checks the lease.
    pub retry_period: Duration,
}

impl LeaderElectionConfig {
    /// A 15 s lease renewed every 5 s, the leader giving up after 10 s without a
    /// successful renewal (client-go's defaults, with the renewal every L/3).
    pub fn new(namespace: impl Into<String>, lease_name: impl Into<String>, identity: impl Into<String>) -> Self {
        LeaderElectionConfig {
            namespace: namespace.into(),
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(5),
        }
    }

    /// Sets the lease duration L, with renewal every L/3 and the renew deadline
    /// at 2L/3.
    pub fn with_lease_duration(mut self, lease_duration: Duration) -> Self {
        let lease_duration = whole_seconds(lease_duration);
        self.lease_duration = lease_duration;
        self.renew_deadline = lease_duration * 2 / 3;
        self.retry_period = lease_duration / 3;
        self
    }

    fn validate(&self) -> Result<()> {
        let fail = |why: &str| Err(Error::InvalidConfig(format!("leader election: {why}")));
        if self.identity.is_empty() {
            return fail("identity is empty");
        }
        if self.namespace.is_empty() || self.lease_name.is_empty() {
            return fail("lease namespace and name are required");
        }
        if whole_seconds(self.lease_duration) != self.lease_duration {
            return fail("lease duration must be whole seconds (at least 1 s)");
        }
        if self.renew_deadline >= self.lease_duration {
            return fail("renew deadline must be shorter than the lease duration");
        }
        if self.retry_period.is_zero() || self.retry_period >= self.renew_deadline {
            return fail("retry period must be positive and shorter than the renew deadline");
        }
        Ok(())
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

/// Rounds up to whole seconds, at least one.
fn whole_seconds(d: Duration) -> Duration {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    Duration::from_secs(secs.max(1))
}

/// Counts duties currently running, so a graceful shutdown can wait for them to
/// stop before it hands the lease over.
#[derive(Default)]
struct ActiveDuties {
    count: AtomicUsize,
    idle: Notify,
}

struct DutyGuard(Arc<ActiveDuties>);

impl DutyGuard {
    fn enter(active: &Arc<ActiveDuties>) -> Self {
        active.count.fetch_add(1, Ordering::SeqCst);
        DutyGuard(active.clone())
    }
}

impl Drop for DutyGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Aborts a duty whose runner is dropped, so cancelling the runner never
/// leaves the duty running unsupervised.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether this replica leads, as seen by duties. Cheap to clone.
///
/// Obtained from a [`LeaderElector`] or, in embedded mode, from
/// [`Leadership::always`].
#[derive(Clone)]
pub struct Leadership {
    leading: watch::Receiver<bool>,
    active: Arc<ActiveDuties>,
    /// Keeps the channel open for [`Leadership::always`].
    _always: Option<Arc<watch::Sender<bool>>>,
}

impl Leadership {
    /// A leadership that is always held: the single process of embedded mode.
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Leadership { leading: rx, active: Arc::default(), _always: Some(Arc::new(tx)) }
    }

    /// Whether this replica leads right now.
    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// A receiver following leadership changes. Closed once the elector is gone
    /// (treat that as "not leading").
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    /// Runs `duty` while this replica leads: starts it (fresh from `make_duty`)
    /// each time leadership is gained, cancels it when leadership is lost and
    /// waits until it has stopped. A duty that ends on its own while still
    /// leading is restarted after `restart_delay`. Returns once the elector is
    /// gone, with the duty stopped.
    pub async fn run_while_leading<F, Fut>(&self, name: &str, restart_delay: Duration, mut make_duty: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut leading = self.leading.clone();
        loop {
            if leading.wait_for(|l| *l).await.is_err() {
                return;
            }
            let _running = DutyGuard::enter(&self.active);
            info!(duty = name, "leading: starting duty");
            let mut task = Some(AbortOnDrop(tokio::spawn(make_duty())));
            let elector_gone = loop {
                tokio::select! {
                    lost = leading.wait_for(|l| !*l) => break lost.is_err(),
                    ended = async {
                        match task.as_mut() {
                            Some(running) => (&mut running.0).await,
                            None => std::future::pending().await,
                        }
                    } => {
                        task = None;
                        match ended {
                            Ok(()) => warn!(duty = name, "duty ended on its own; restarting it while leading"),
                            Err(e) => warn!(duty = name, error = %e, "duty failed; restarting it while leading"),
                        }
                    }
                    () = tokio::time::sleep(restart_delay), if task.is_none() => {
                        task = Some(AbortOnDrop(tokio::spawn(make_duty())));
                    }
                }
            };
            if let Some(mut running) = task {
                running.0.abort();
                // Wait until it is really gone, so no part of it overlaps the next leader.
                let _ = (&mut running.0).await;
            }
            info!(duty = name, "leadership lost: duty stopped");
            if elector_gone {
                return;
            }
        }
    }

    /// Resolves once no duty started through this leadership is running.
    async fn duties_stopped(&self) {
        loop {
            let idle = self.active.idle.notified();
            if self.active.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// A running candidate for one Lease. Dropping it stops campaigning without
/// releasing the lease (as a crash would: others take over once it expires);
/// [`LeaderElector::shutdown`] hands it over at once.
pub struct LeaderElector {
    leadership: Leadership,
    leading_tx: Arc<watch::Sender<bool>>,
    api: Api<Lease>,
    config: LeaderElectionConfig,
    task: JoinHandle<()>,
}

impl LeaderElector {
    /// Starts campaigning. The lease is created if it does not exist.
    pub fn start(client: kube::Client, config: LeaderElectionConfig) -> Result<Self> {
        config.validate()?;
        let api: Api<Lease> = Api::namespaced(client, &config.namespace);
        let (tx, rx) = watch::channel(false);
        let tx = Arc::new(tx);
        let span = tracing::info_span!("leader_election", lease = %config.lease_name, identity = %config.identity);
        let candidate = Candidate { api: api.clone(), config: config.clone(), observed: None };
        let task = tokio::spawn(campaign(candidate, tx.clone()).instrument(span));
        Ok(LeaderElector {
            leadership: Leadership { leading: rx, active: Arc::default(), _always: None },
            leading_tx: tx,
            api,
            config,
            task,
        })
    }

    /// What duties follow.
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// A receiver following leadership changes.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leadership.subscribe()
    }

    pub fn is_leader(&self) -> bool {
        self.leadership.is_leader()
    }

    /// Stops campaigning; if leading, stops the duties (waiting up to the renew
    /// deadline for them) and then releases the lease so another replica takes
    /// over without waiting for it to expire.
    pub async fn shutdown(self) -> Result<()> {
        self.task.abort();
        let was_leading = self.leadership.is_leader();
        self.leading_tx.send_replace(false);
        if !was_leading {
            return Ok(());
        }
        if tokio::time::timeout(self.config.renew_deadline, self.leadership.duties_stopped()).await.is_err() {
            // Releasing now could let a duty overlap with the next leader's: let
            // the lease expire instead.
            warn!("duties did not stop in time; not releasing the lease");
            return Ok(());
        }
        release(&self.api, &self.config).await
    }
}

impl Drop for LeaderElector {
    fn drop(&mut self) {
        self.task.abort();
        self.leading_tx.send_replace(false);
    }
}

/// The fields that identify one version of the lease record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<String>,
    resource_version: Option<String>,
}

impl Record {
    fn of(lease: &Lease) -> Self {
        let spec = lease.spec.as_ref();
        Record {
            holder: spec.and_then(|s| s.holder_identity.clone()).filter(|h| !h.is_empty()),
            renew_time: spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0.to_string()),
            resource_version: lease.metadata.resource_version.clone(),
        }
    }
}

/// A record and when (by our clock) we first saw it.
struct Observed {
    record: Record,
    since: Instant,
    lease_duration: Duration,
}

struct Candidate {
    api: Api<Lease>,
    config: LeaderElectionConfig,
    observed: Option<Observed>,
}

impl Candidate {
    /// One attempt: acquire the lease if free or expired, renew it if ours.
    /// `Ok(true)` when we hold it after this call.
    async fn try_acquire_or_renew(&mut self) -> Result<bool> {
        let name = &self.config.lease_name.clone();
        let now = Instant::now();
        let existing = self.api.get_opt(name).await.map_err(|e| Error::kube(format!("reading lease {name}"), e))?;
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.spec_for_acquire(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.observe(&created, now);
                    info!("created the lease and became leader");
                    Ok(true)
                }
                // Another replica created it first.
                Err(e) if api_status(&e) == Some(409) => Ok(false),
                Err(e) => Err(Error::kube(format!("creating lease {name}"), e)),
            };
        };
        self.observe(&lease, now);
        let observed = self.observed.as_ref().expect("just observed");
        let ours = observed.record.holder.as_deref() == Some(self.config.identity.as_str());
        if !ours && observed.record.holder.is_some() && now.duration_since(observed.since) < observed.lease_duration {
            return Ok(false);
        }
        let previous = lease.spec.take();
        lease.spec = Some(if ours {
            self.spec_for_renew(previous)
        } else {
            debug!(previous_holder = ?observed.record.holder, "lease free or expired: acquiring");
            self.spec_for_acquire(previous)
        });
        // `replace` sends the resourceVersion we read: a concurrent writer makes it a 409.
        match self.api.replace(name, &PostParams::default(), &lease).await {
            Ok(written) => {
                self.observe(&written, now);
                if !ours {
                    info!("acquired the lease");
                }
                Ok(true)
            }
            Err(e) if api_status(&e) == Some(409) => {
                debug!("lost a race for the lease");
                Ok(false)
            }
            Err(e) => Err(Error::kube(format!("writing lease {name}"), e)),
        }
    }

    fn observe(&mut self, lease: &Lease, now: Instant) {
        let record = Record::of(lease);
        let lease_duration = lease
            .spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(s as u64))
            .unwrap_or(self.config.lease_duration);
        match &mut self.observed {
            Some(o) if o.record == record => o.lease_duration = lease_duration,
            _ => self.observed = Some(Observed { record, since: now, lease_duration }),
        }
    }

    fn spec_for_acquire(&self, previous: Option<LeaseSpec>) -> LeaseSpec {
        let transitions = previous.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
        let had_holder = previous.as_ref().and_then(|s| s.holder_identity.as_ref()).is_some_and(|h| !h.is_empty());
        let now = MicroTime(jiff::Timestamp::now());
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_seconds()),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(if had_holder { transitions + 1 } else { transitions }),
            ..previous.unwrap_or_default()
        }
    }

    fn spec_for_renew(&self, previous: Option<LeaseSpec>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: Some(self.config.lease_seconds()),
            renew_time: Some(MicroTime(jiff::Timestamp::now())),
            ..previous.unwrap_or_default()
        }
    }
}

async fn campaign(mut candidate: Candidate, leading: Arc<watch::Sender<bool>>) {
    let config = candidate.config.clone();
    // While leading: the instant until which we may believe it.
    let mut leading_until: Option<Instant> = None;
    let set = |value: bool| {
        leading.send_if_modified(|l| {
            let changed = *l != value;
            *l = value;
            changed
        });
    };
    loop {
        let attempt_start = Instant::now();
        if leading_until.is_some_and(|deadline| attempt_start >= deadline) {
            warn!("no successful renewal before the renew deadline: stepping down");
            leading_until = None;
            set(false);
        }
        // A leader's attempt may not outlive its deadline; a follower's is
        // bounded so a hung request does not stall the campaign.
        let budget = match leading_until {
            Some(deadline) => deadline.saturating_duration_since(attempt_start),
            None => config.retry_period,
        };
        match tokio::time::timeout(budget, candidate.try_acquire_or_renew()).await {
            Ok(Ok(true)) => {
                if leading_until.is_none() {
                    info!("leading");
                }
                leading_until = Some(attempt_start + config.renew_deadline);
                set(true);
            }
            Ok(Ok(false)) => {
                if leading_until.take().is_some() {
                    warn!("another replica holds the lease: stepping down");
                }
                set(false);
            }
            Ok(Err(e)) => warn!(error = %e, "lease attempt failed"),
            Err(_) => warn!(timeout = ?budget, "lease attempt timed out"),
        }
        let mut next = attempt_start + config.retry_period;
        if let Some(deadline) = leading_until {
            next = next.min(deadline);
        }
        tokio::time::sleep_until(next).await;
    }
}

/// Gives the lease up if we still hold it: clears the holder and sets a 1 s
/// duration (as client-go does), conditioned on the version we read.
async fn release(api: &Api<Lease>, config: &LeaderElectionConfig) -> Result<()> {
    let name = &config.lease_name;
    let Some(mut lease) = api.get_opt(name).await.map_err(|e| Error::kube(format!("reading lease {name}"), e))? else {
        return Ok(());
    };
    let Some(spec) = lease.spec.as_mut() else {
        return Ok(());
    };
    if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
        return Ok(());
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
    match api.replace(name, &PostParams::default(), &lease).await {
        Ok(_) => {
            info!("released the lease");
            Ok(())
        }
        // Someone else wrote it meanwhile: it is not ours to release any more.
        Err(e) if api_status(&e) == Some(409) => Ok(()),
        Err(e) => Err(Error::kube(format!("releasing lease {name}"), e)),
    }
}
