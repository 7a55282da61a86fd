//! Keeping a lease alive from a background task.
//!
//! Renewing at a third of the TTL leaves two more attempts before expiry, so one
//! slow or failed renewal (a reconnect, a leader election) does not lose the
//! lease. Once the store answers "lease not found" the lease is gone for good and
//! the keeper reports [`LeaseStatus::Lost`]; re-granting and re-writing the keys
//! is the owner's decision (the [`crate::SharedStore`] does it automatically).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, warn};

use crate::{KvError, KvStore, Lease, LeaseId};

/// State of a kept-alive lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    /// The last renewal succeeded (or none failed definitively yet).
    Alive,
    /// Renewals are failing because the store is unreachable; the lease may
    /// still exist and is renewed again as soon as the store answers.
    Unreachable,
    /// The store says the lease no longer exists; its keys are gone.
    Lost,
}

/// Keeps one lease alive until dropped (dropping does not revoke: the lease
/// then expires after its TTL; call [`LeaseKeeper::revoke`] to end it now).
pub struct LeaseKeeper {
    store: Arc<dyn KvStore>,
    lease: Lease,
    status: watch::Receiver<LeaseStatus>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// Grants a lease of `ttl` and starts renewing it.
    pub async fn grant(store: Arc<dyn KvStore>, ttl: Duration) -> crate::Result<Self> {
        let lease = store.grant_lease(ttl).await?;
        Ok(Self::start(store, lease))
    }

    /// Starts renewing an existing lease.
    pub fn start(store: Arc<dyn KvStore>, lease: Lease) -> Self {
        let (tx, status) = watch::channel(LeaseStatus::Alive);
        let span = tracing::debug_span!("lease_keeper", lease = lease.id);
        let task = tokio::spawn(keep_alive_loop(store.clone(), lease, tx).instrument(span));
        LeaseKeeper { store, lease, status, task }
    }

    pub fn id(&self) -> LeaseId {
        self.lease.id
    }

    pub fn lease(&self) -> Lease {
        self.lease
    }

    /// Current status.
    pub fn status(&self) -> LeaseStatus {
        *self.status.borrow()
    }

    /// A receiver to follow status changes.
    pub fn subscribe(&self) -> watch::Receiver<LeaseStatus> {
        self.status.clone()
    }

    /// Resolves once the lease is lost.
    pub async fn lost(&self) {
        let mut rx = self.status.clone();
        // Err only if the task ended without reporting loss (aborted): treat as lost.
        let _ = rx.wait_for(|s| *s == LeaseStatus::Lost).await;
    }

    /// Stops renewing and revokes the lease, deleting its keys now.
    pub async fn revoke(self) -> crate::Result<()> {
        self.task.abort();
        match self.store.revoke_lease(self.lease.id).await {
            Ok(()) | Err(KvError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The renewal period for a TTL: a third of it, but not absurdly small.
pub(crate) fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(50))
}

async fn keep_alive_loop(store: Arc<dyn KvStore>, lease: Lease, status: watch::Sender<LeaseStatus>) {
    let interval = renew_interval(lease.ttl);
    loop {
        tokio::time::sleep(interval).await;
        match store.keep_alive(lease.id).await {
            Ok(()) => {
                status.send_if_modified(|s| {
                    let changed = *s != LeaseStatus::Alive;
                    *s = LeaseStatus::Alive;
                    changed
                });
            }
            Err(KvError::LeaseNotFound(_)) => {
                warn!("lease lost");
                status.send_replace(LeaseStatus::Lost);
                return;
            }
            Err(e) => {
                debug!(error = %e, "lease renewal failed; will retry");
                status.send_if_modified(|s| {
                    let changed = *s != LeaseStatus::Unreachable;
                    *s = LeaseStatus::Unreachable;
                    changed
                });
            }
        }
    }
}
